"""kv_cache"""
