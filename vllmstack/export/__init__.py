"""`invoke export`: a profile taken beyond one box, with its own argv, image, GPUs, files and checks.

`spec` gathers what every target needs from a resolved profile (`EngineSpec`), `layout` reads the
engine container's layout from compose.yaml; the targets are `helm` (production-stack values, with
`chart`: what the chart's templates do with them), `kube` (manifests, with `pod`: what every
Kubernetes target shares) and `quadlet` (a Podman unit); `validate` checks each offline;
`service` plans, validates and writes (`invoke check --target` shows a plan's findings).
"""
