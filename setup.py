"""Kept for tools that call setup.py; the metadata lives in pyproject.toml (PEP 621)."""
from setuptools import setup

setup()
