"""Pipelines of logit-distill: the distillation DAG (local / Kubeflow and Vertex AI variants),
compile, Vertex submit and the local demo. Run from the repository root: ``python -m pipelines.demo``."""
