"""Kernel templates, installed as the package data mpfa_jit.templates (see pyproject.toml)."""
