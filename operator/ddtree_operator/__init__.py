"""Kubernetes operator for DDTreeDeployment resources."""
