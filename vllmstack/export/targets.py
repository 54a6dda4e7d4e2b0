"""The export targets' names (light: the task declarations read them when tasks.py loads)."""

from __future__ import annotations

PRODUCTION_STACK = "production-stack"
KUBE = "kube"
QUADLET = "quadlet"
KSERVE = "kserve"
LLM_D = "llm-d"
LWS = "lws"
TARGETS = (PRODUCTION_STACK, KUBE, QUADLET, KSERVE, LLM_D, LWS)
# The targets whose values are a Helm chart's (--chart-schema), and whose documents are a
# custom resource of a CRD the user can name (--crd).
CHART_TARGETS = (PRODUCTION_STACK, LLM_D)
CRD_TARGETS = {KSERVE: ("LLMInferenceService", "v1alpha1"), LWS: ("LeaderWorkerSet", "v1")}
