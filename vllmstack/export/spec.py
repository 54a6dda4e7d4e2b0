"""Everything an exported engine needs, gathered once from a resolved profile.

Every target (production-stack values, Kubernetes manifests, a Quadlet unit) is written from one
`EngineSpec`, so the targets cannot disagree: the argv is the one `invoke config --vllm-args`
prints (built by the same function), the image is the profile's, the environment is the one
both runtimes give the engine plus compose.yaml's layout, the files are the ones compose mounts.
Nothing here is re-derived from the settings a second way.

Secrets never travel as values: a secret setting (HF_TOKEN, ...) becomes a `SecretEnv`, and the
value of a secret flag in the argv (`--api-key V`) becomes a reference to a variable that a
secret fills in where the engine runs (`Secret.placeholder`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from vllmstack.config.engines.kind import Placement
from vllmstack.config.engines.table import engine_kind, kind_named
from vllmstack.config.profiles import Resolved
from vllmstack.config.schema import load_schema
from vllmstack.config.vllm_args import CHAT_TEMPLATE_KEY, ArgvError, ServeCommand
from vllmstack.core.errors import StackError
from vllmstack.core.findings import Finding
from vllmstack.core.paths import Project, home_dir
from vllmstack.core.runner import MASK, Runner, is_secret_name, mask_argv
from vllmstack.export.layout import CHAT_TEMPLATES, MOE_CONFIGS, Layout, read_layout
from vllmstack.image import build, patches
from vllmstack.runtime.compose_files import PACKAGE_LABEL
from vllmstack.runtime.engine_env import FP8_CONFIG_DIR, engine_environment, stack_paths

PARALLEL_FLAGS = {"--tensor-parallel-size": "tp", "-tp": "tp", "--pipeline-parallel-size": "pp",
                  "-pp": "pp", "--data-parallel-size": "dp", "-dp": "dp"}
SECRET_PREFIX = "VLLMSTACK_SECRET_"


class ExportError(StackError):
    """A profile cannot be exported as asked; the message names the setting and the fix."""


@dataclass(frozen=True)
class SecretEnv:
    """An engine variable whose value lives in a secret store (Kubernetes Secret, Podman secret):
    `name` is the variable, `key` the key in the store, `origin` what it came from."""

    name: str
    key: str
    origin: str
    in_argv: bool = False  # a flag's value in the argv (else a variable of the environment)


@dataclass(frozen=True)
class MountedFile:
    """A file of this project that the engine reads at `target` inside the container."""

    source: Path
    target: str


@dataclass(frozen=True)
class FolderMount:
    """A host folder compose mounts whole (the Quadlet unit mounts it the same way)."""

    source: Path
    target: str
    read_only: bool = True


@dataclass
class EngineSpec:
    profile: str
    platform: str
    engine: str                      # vllm | llamacpp
    argv: list[str]                  # secret values replaced by Secret placeholders
    image: str
    image_labels: dict[str, str]     # the image's vllmstack.* labels, when it could be inspected
    vendor: str                      # amd | nvidia | none
    gpus: int                        # GPUs the engine uses (TP x PP x DP; llama.cpp: GPU_COUNT)
    node_gpus: int                   # GPUs one box of this platform has (GPU_COUNT)
    port: int
    served_name: str
    model: str                       # the model argument (vLLM) or GGUF path (llama.cpp)
    env: dict[str, str]              # the engine's plain environment (layout + settings)
    secrets: list[SecretEnv]
    files: list[MountedFile]         # what a pod gets from a ConfigMap
    folders: list[FolderMount]       # what the Quadlet unit mounts from this host
    layout: Layout
    resolved: Resolved
    host_roots: list[Path]           # this host's user folders (home, cache folders)
    findings: list[Finding] = field(default_factory=list)
    image_digest: str | None = None  # REPO@sha256:... of the image, when it came from a registry

    @property
    def pinned_image(self) -> str:
        """The image a cluster pulls: by its registry digest when this host knows it (the same
        bytes on every node, whatever the tag points at later), else the name."""
        return self.image_digest or self.image

    @property
    def entrypoint(self) -> list[str]:
        return self.argv[:len(kind_named(self.engine).entrypoint)]

    @property
    def command_args(self) -> list[str]:
        """The argv after the image's entrypoint (what compose's `command` holds)."""
        return self.argv[len(kind_named(self.engine).entrypoint):]

    @property
    def models_dir(self) -> str:
        """MODELS_DIR as the argv names files under it (expanded: `~/models` -> /home/u/models)."""
        raw = self.resolved.get_str("MODELS_DIR").strip()
        return str(Path(raw).expanduser()) if raw else ""

    def setting(self, key: str) -> str:
        return self.resolved.get_str(key)

    def finding(self, severity: str, code: str, message: str, *, key: str | None = None,
                fix: str | None = None) -> None:
        self.findings.append(Finding(severity, code, message, key=key,
                                     source=self.resolved.source(key) if key else None, fix=fix))


def placeholder(name: str) -> str:
    """How the argv names a secret's variable until a target writes its own reference form."""
    return f"<secret:{name}>"


PLACEHOLDER = re.compile(r"<secret:([A-Z_][A-Z0-9_]*)>")


def engine_command(resolved: Resolved) -> ServeCommand:
    """The engine's argv exactly as `invoke config --vllm-args` prints it (and `up` runs it)."""
    try:
        return engine_kind(resolved).build(resolved, Placement())  # a container's
    except ArgvError as exc:
        raise ExportError(exc.cause, exc.fix) from exc


def engine_spec(project: Project, resolved: Resolved, environ: Mapping[str, str],
                runner: Runner) -> EngineSpec:
    """Gather the spec of one profile; `runner` only inspects the image's labels (read-only)."""
    layout = read_layout(project)
    command = engine_command(resolved)
    kind = engine_kind(resolved)
    argv, flag_secrets = _argv_secrets(command.argv)
    image = kind.image(resolved)
    labels = build.read_image_labels(runner, resolved.get_str("DOCKER"), image)
    env, env_secrets = _environment(resolved, layout)
    spec = EngineSpec(
        profile=resolved.profile, platform=resolved.platform, engine=kind.name, argv=argv,
        image=image, image_labels={k: v for k, v in (labels or {}).items()
                                   if k.startswith(build.LABEL)},
        vendor=resolved.get_str("GPU_VENDOR"), gpus=0, node_gpus=resolved.get_int("GPU_COUNT"),
        port=resolved.get_int("VLLM_PORT"), served_name=resolved.get_str("VLLM_SERVED_NAME"),
        model=kind.model_label(resolved),
        env=env, secrets=[*env_secrets, *flag_secrets], files=[], folders=[], layout=layout,
        resolved=resolved, host_roots=_host_roots(resolved, environ))
    spec.image_digest = read_image_digest(runner, resolved.get_str("DOCKER"), image)
    spec.findings += [f for f in resolved.problems if f.severity == "error"]
    spec.gpus = _parallel_gpus(argv) if kind.gpus_from_argv else spec.node_gpus
    if spec.vendor == "none":
        spec.gpus = 0
    _collect_files(project, spec, labels)
    return spec


def read_image_digest(runner: Runner, docker: str, image: str) -> str | None:
    """The image's registry digest for the repository its name points at (`docker image
    inspect`'s RepoDigests: set once the image was pulled or pushed), None for a build that
    never left this host or an image that is not here."""
    result = runner.run([docker, "image", "inspect", "--format", "{{json .RepoDigests}}", image],
                        mutates=False)
    if not result.ok:
        return None
    try:
        digests = json.loads(result.stdout or "null")
    except json.JSONDecodeError:
        return None
    name = image.split("@", 1)[0]
    if ":" in name.rsplit("/", 1)[-1]:
        name = name.rsplit(":", 1)[0]
    matching = [d for d in digests if isinstance(d, str) and d.split("@", 1)[0] == name] \
        if isinstance(digests, list) else []
    return matching[0] if matching else None


def _host_roots(resolved: Resolved, environ: Mapping[str, str]) -> list[Path]:
    paths = stack_paths(resolved, environ)
    return [home_dir(environ), paths.hf_cache, paths.engine_cache]


def _argv_secrets(argv: list[str]) -> tuple[list[str], list[SecretEnv]]:
    """The argv with each secret flag's value (`--api-key V`, `--hf-token=V`) replaced by a
    placeholder, and the secrets that fill them in."""
    out: list[str] = []
    secrets: list[SecretEnv] = []
    for index, (word, masked) in enumerate(zip(argv, mask_argv(argv), strict=True)):
        if word == masked:
            out.append(word)
            continue
        inline = masked.endswith("=" + MASK) and masked != MASK
        flag = masked[: -len(MASK) - 1] if inline else argv[index - 1]
        name = SECRET_PREFIX + re.sub(r"[^A-Z0-9]+", "_", flag.lstrip("-").upper()).strip("_")
        if name not in {s.name for s in secrets}:
            secrets.append(SecretEnv(name, name, f"the value of {flag} in the argv", in_argv=True))
        out.append(f"{flag}={placeholder(name)}" if inline else placeholder(name))
    return out, secrets


def _environment(resolved: Resolved, layout: Layout) -> tuple[dict[str, str], list[SecretEnv]]:
    """compose.yaml's static variables, then the settings' (they win, as in the compose
    override); secret variables are split off as references."""
    merged = {**layout.environment, **engine_environment(resolved, resolved.schema or load_schema())}
    plain = {k: v for k, v in merged.items() if not is_secret_name(k)}
    secrets = [SecretEnv(k, k, f"the setting {k}") for k in sorted(merged) if is_secret_name(k)]
    return plain, secrets


def _parallel_gpus(argv: list[str]) -> int:
    """TP x PP x DP as the argv says (the last occurrence of a flag wins, as in argparse)."""
    sizes = parallel_sizes(argv)
    return sizes["tp"] * sizes["pp"] * sizes["dp"]


def parallel_sizes(argv: list[str]) -> dict[str, int]:
    """{"tp": .., "pp": .., "dp": ..} as the argv says (the last occurrence of a flag wins)."""
    sizes = {"tp": 1, "pp": 1, "dp": 1}
    for index, word in enumerate(argv):
        flag, eq, value = word.partition("=")
        if flag in PARALLEL_FLAGS:
            text = value if eq else (argv[index + 1] if index + 1 < len(argv) else "")
            if text.isdigit():
                sizes[PARALLEL_FLAGS[flag]] = int(text)
    return sizes


def _collect_files(project: Project, spec: EngineSpec, labels: Mapping[str, str] | None) -> None:
    """The project files the engine reads, as compose mounts them: the chat template the argv
    names, the fused-MoE configs, and, when the image says where vLLM is installed, the runtime
    overlays and the block-FP8 configs of this platform's device."""
    resolved, root = spec.resolved, project.root
    templates = root / "chat-templates"
    moe = root / "fused_moe_configs"
    if templates.is_dir():
        spec.folders.append(FolderMount(templates, spec.layout.mounts[CHAT_TEMPLATES]))
    if moe.is_dir():
        spec.folders.append(FolderMount(moe, spec.layout.mounts[MOE_CONFIGS]))
    if not engine_kind(resolved).vllm_cli:
        return  # only `vllm serve` takes a chat template file (llama-server: --jinja, its own)
    template = resolved.get_str(CHAT_TEMPLATE_KEY).strip()
    if template:
        path = templates / template
        if path.is_file():
            spec.files.append(MountedFile(path, f"{spec.layout.mounts[CHAT_TEMPLATES]}/{template}"))
        else:
            spec.finding("error", "export-chat-template-missing",
                         f"{CHAT_TEMPLATE_KEY}={template}, but chat-templates/{template} does not "
                         "exist, so there is nothing to put in the engine's ConfigMap",
                         key=CHAT_TEMPLATE_KEY, fix=f"add chat-templates/{template} or unset "
                         f"{CHAT_TEMPLATE_KEY}")
    device = resolved.get_str("GPU_DEVICE_NAME")
    for path in sorted(moe.glob("*.json")) if moe.is_dir() else []:
        # vLLM looks the file up by the device's name; another device's file is never read here.
        if not device or f"device_name={device}" in path.name:
            spec.files.append(MountedFile(path, f"{spec.layout.mounts[MOE_CONFIGS]}/{path.name}"))
    package = (labels or {}).get(PACKAGE_LABEL)
    overlays = patches.load_overlays(project)
    fp8 = [p for p in sorted((root / "fp8_configs").glob("*.json"))
           if device and f"device_name={device}," in p.name]
    if package:
        for overlay in overlays:
            spec.files.append(MountedFile(Path(overlay.file).resolve(),
                                          f"{package}/{overlay.target.removeprefix('vllm/')}"))
        spec.files += [MountedFile(p, f"{package}/{FP8_CONFIG_DIR}/{p.name}") for p in fp8]
    elif overlays or fp8:
        what = ", ".join([*(f"overlay {o.name}" for o in overlays), *(f"fp8_configs/{p.name}"
                                                                      for p in fp8)])
        spec.finding("warning", "export-image-not-inspected",
                     f"{spec.image} is not on this host (or has no {PACKAGE_LABEL} label), so where "
                     f"vLLM is installed in it is unknown and {what} are not carried; `invoke up` "
                     "mounts them", key="VLLM_IMAGE",
                     fix=f"invoke build --platform {spec.platform} (or pull the image), then export "
                         "again")


def describe(spec: EngineSpec) -> dict[str, str]:
    """Annotations every target puts on the engine: where it came from, and the image's labels
    (pins, commits, patch-set hashes) when the image could be inspected."""
    notes = {"vllmstack/profile": spec.profile, "vllmstack/platform": spec.platform,
             "vllmstack/engine": spec.engine, "vllmstack/argv": json.dumps(spec.argv)}
    if spec.image_digest:
        notes["vllmstack/image-digest"] = spec.image_digest
    for label, value in sorted(spec.image_labels.items()):
        notes["vllmstack/" + label.removeprefix(build.LABEL)] = value
    return notes
