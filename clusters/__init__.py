"""Cluster factories: local CPU, local CUDA, SSH, Kubernetes, SLURM."""
