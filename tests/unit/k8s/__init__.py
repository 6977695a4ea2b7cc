"""The Kubernetes manifests, proven without a cluster: every object of each rendered overlay is valid for
the Kubernetes API, and the objects agree with each other and with the programs they run.

Rendering is real kustomize (tests/k8s_render.py); the schemas are the Kubernetes OpenAPI schemas shipped
in the `kubernetes-validate` package (offline, strict: an unknown field is an error). What the CLI reads
is taken from `keyroute.cli.build_parser`, what the apps serve from their route tables.
"""
