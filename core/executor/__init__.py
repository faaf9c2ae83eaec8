"""executor"""
