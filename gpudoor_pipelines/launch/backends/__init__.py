"""Backends that run a resolved job: ``local`` (the embedded default) and ``skypilot`` (production)."""
