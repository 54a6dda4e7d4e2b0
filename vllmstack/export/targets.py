"""The export targets' names (light: the task declarations read them when tasks.py loads)."""

from __future__ import annotations

PRODUCTION_STACK = "production-stack"
KUBE = "kube"
QUADLET = "quadlet"
TARGETS = (PRODUCTION_STACK, KUBE, QUADLET)
