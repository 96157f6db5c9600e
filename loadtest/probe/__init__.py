"""Helpers and items of ``loadtest/probe_hardening.py``: ``procs`` (processes), ``client``
(HTTP), and the items by concept: ``items_requests``, ``items_processes``, ``items_redis``."""
