"""Adapters to serving frameworks. Each uses capdispatch's public API only; the
core never imports an adapter."""
