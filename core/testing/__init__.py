"""Test helpers shipped with pagedserve (the platform conformance kit lives here)."""
