"""`ddtree-operator`: run kopf with the DDTreeDeployment handlers, taking kopf's scoping flags."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import kopf


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddtree-operator", description="Kubernetes operator for DDTreeDeployment")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable; globs like ml-* and negations !x work as in kopf)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    p.add_argument("--standalone", action="store_true", help="no peering: run as the only operator instance")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", metavar="URL",
                   help="kopf liveness endpoint (empty to disable)")
    p.add_argument("--metrics-port", type=int, default=int(os.environ.get("DDTREE_OPERATOR_METRICS_PORT", "8081")),
                   help="Prometheus metrics port (0 disables)")
    p.add_argument("--server-image", default=os.environ.get("DDTREE_SERVER_IMAGE"),
                   help="server image for DDTreeDeployments that do not set spec.image")
    p.add_argument("--prometheus-address", default=os.environ.get("DDTREE_PROMETHEUS_ADDRESS"), metavar="URL",
                   help="Prometheus that KEDA queries for DDTreeDeployments whose spec.autoscaling names none")
    p.add_argument("--resync-seconds", type=float,
                   default=float(os.environ.get("DDTREE_OPERATOR_RESYNC_SECONDS", "15")),
                   help="how often every DDTreeDeployment is re-reconciled")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.namespace and not args.all_namespaces:
        print("ddtree-operator: error: pass --namespace NS (repeatable) or --all-namespaces", file=sys.stderr)
        return 2
    # The handlers read these at import time (the timer interval is fixed when it is registered).
    os.environ["DDTREE_OPERATOR_METRICS_PORT"] = str(args.metrics_port)
    os.environ["DDTREE_OPERATOR_RESYNC_SECONDS"] = str(args.resync_seconds)
    if args.server_image:
        os.environ["DDTREE_SERVER_IMAGE"] = args.server_image
    if args.prometheus_address:
        os.environ["DDTREE_PROMETHEUS_ADDRESS"] = args.prometheus_address
    # Exact namespaces (or all of them) need no watch on Namespaces and CRDs: no cluster-scoped permissions.
    exact = args.all_namespaces or not any(set(ns) & set("*?[!") for ns in args.namespace)
    os.environ["DDTREE_OPERATOR_SCANNING"] = "off" if exact else "on"
    import ddtree_operator.handlers  # noqa: F401  (registers the handlers with kopf)

    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    kopf.run(standalone=args.standalone, clusterwide=args.all_namespaces, namespaces=args.namespace,
             liveness_endpoint=args.liveness or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
