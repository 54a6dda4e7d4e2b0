"""`invoke export --to quadlet`: a Podman Quadlet `.container` unit that runs the profile on this
host the way `invoke up` does, for systemd's podman-system-generator (Podman >= 4.4).

The unit is the compose service, key by key: the image, the argv after the image's entrypoint
(`Exec=`), the GPU devices (AMD: /dev/kfd, /dev/dri, the host's video and render gids, SELinux
labels off; NVIDIA: the CDI device), the engine running as the invoking user, the cache folders
and the project's chat templates and tuned configs as volumes, the environment, the published
port, and compose's health check. Quadlet 4.4 knows only some keys (QUADLET_44_KEYS); what came
later (GroupAdd, ShmSize, HealthCmd, Secret, SecurityLabelDisable, StopTimeout) is written as
the `podman run` flags of the same meaning in `PodmanArgs=`, which every Quadlet passes on.

Quoting: Quadlet splits Exec=, Environment=, Label= and PodmanArgs= into words like systemd
(double quotes, backslash escapes), then copies them into the service's ExecStart=, where systemd
expands `%` specifiers and `$VARIABLES`; literal `%` and `$` are therefore doubled.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from vllmstack.config.profiles import Resolved, Setting
from vllmstack.core.findings import Finding
from vllmstack.export.layout import ENGINE_CACHE, HF_CACHE
from vllmstack.export.spec import PLACEHOLDER, EngineSpec, describe
from vllmstack.runtime.engine_env import detect_host_ids, stack_paths

# The [Container] keys of Quadlet in Podman 4.4.0 (pkg/systemd/quadlet: supportedContainerKeys);
# Quadlet refuses a unit with any other key.
QUADLET_44_KEYS = frozenset({
    "ContainerName", "Image", "Environment", "EnvironmentFile", "EnvironmentHost", "Exec",
    "NoNewPrivileges", "DropCapability", "AddCapability", "ReadOnly", "RemapUsers", "RemapUid",
    "RemapGid", "RemapUidSize", "Notify", "ExposeHostPort", "PublishPort", "User", "Group",
    "Volume", "PodmanArgs", "Label", "Annotation", "RunInit", "VolatileTmp", "Timezone",
    "SeccompProfile", "AddDevice", "Network"})
NVIDIA_CDI = "nvidia.com/gpu=all"
SHM = re.compile(r"^(\d+)(Mi|Gi)$")
NEEDS_QUOTES = re.compile(r"[\s\"'\\;#]")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# systemd starts the unit when the container runs (conmon notifies); pulling a large image can
# take longer than systemd's default 90 s.
START_TIMEOUT = 900


def systemd_literal(text: str) -> str:
    """Text systemd must not expand in ExecStart: `%` specifiers and `$` variables doubled."""
    return text.replace("%", "%%").replace("$", "$$")


def unit_word(word: str) -> str:
    """One word as Quadlet's splitter reads it back (plain, or double-quoted with \\ escapes)."""
    if word and not NEEDS_QUOTES.search(word):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def exec_word(word: str) -> str:
    """An argv word: literal text, except that a secret placeholder becomes ${VAR}, which
    systemd fills in from the unit's EnvironmentFile."""
    parts = PLACEHOLDER.split(word)
    return unit_word("".join(systemd_literal(p) if i % 2 == 0 else "${" + p + "}"
                             for i, p in enumerate(parts)))


def words(values: list[str]) -> str:
    return " ".join(unit_word(systemd_literal(v)) for v in values)


def shm_flag(size: str) -> str | None:
    """EXPORT_SHM_SIZE (a Kubernetes quantity) as podman's --shm-size (1g = 1024^3 bytes)."""
    match = SHM.match(size.strip())
    return f"{match.group(1)}{match.group(2)[0].lower()}" if match else None


def unit_name(spec: EngineSpec) -> str:
    return "vllmstack-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", spec.profile)


def build_unit(spec: EngineSpec, resolved: Resolved, environ: dict[str, str],
               root: Path = Path("/")) -> tuple[str, list[Finding]]:
    """The unit's text and what did not translate; `root` is where /dev is read (tests)."""
    container, service, findings = unit_entries(spec, resolved, environ, root)
    return _text(spec, unit_name(spec), container, service), findings


def unit_entries(spec: EngineSpec, resolved: Resolved, environ: dict[str, str],
                 root: Path = Path("/")) -> tuple[list[tuple[str, str]], list[tuple[str, str]],
                                                  list[Finding]]:
    """The unit's [Container] and [Service] entries, as written (quoted, systemd-escaped), and
    what did not translate: the one description of the engine container on a plain host, which
    the unit and `podman run` line (runline.py) both are."""
    findings: list[Finding] = []
    name = unit_name(spec)
    if spec.gpus > spec.node_gpus > 0:
        findings.append(Finding(
            "error", "export-multi-node", f"{spec.profile} needs {spec.gpus} GPUs and this "
            f"{spec.platform} box has {spec.node_gpus}; a Quadlet unit runs on one host",
            key="VLLM_TP", source=resolved.source("VLLM_TP"),
            fix="export it with --to lws or --to kserve (one pod per node), or --to "
                "production-stack, whose raySpec spreads it over nodes"))
    bad = [w for w in [*spec.argv, *spec.env.values()] if CONTROL.search(w)]
    if bad:
        findings.append(Finding("error", "export-control-character",
                                f"{bad[0]!r} holds a control character, which a unit file cannot "
                                "carry as one word", fix="remove it from the setting"))
    ids = detect_host_ids(resolved, root)
    paths = stack_paths(resolved, environ)
    container: list[tuple[str, str]] = [
        ("ContainerName", name),
        ("Image", systemd_literal(spec.image)),
        ("Exec", " ".join(exec_word(w) for w in spec.command_args)),
        ("User", str(ids.uid)),
        ("Group", str(ids.gid)),
        ("PublishPort", f"{resolved.get_str('VLLM_BIND')}:{spec.port}:{spec.port}"),
    ]
    podman: list[list[str]] = []
    if spec.vendor == "amd":
        container += [("AddDevice", "/dev/kfd"), ("AddDevice", "/dev/dri")]
        gids = [str(g) for g in (ids.video_gid, ids.render_gid) if g is not None]
        if ids.render_gid is None:
            findings.append(Finding(
                "warning", "export-render-gid", "the render group's id is not known on this host "
                "(no /dev/dri/renderD*), so the unit adds the group by name, video",
                key="RENDER_GID", fix="set RENDER_GID (and VIDEO_GID) in .env to the GPU host's "
                "ids (stat -c %g /dev/dri/renderD128 /dev/kfd), then export again"))
        for gid in gids or ["video"]:
            podman.append(["--group-add", gid])
        podman.append(["--security-opt", "label=disable"])  # as compose: no device relabelling
    elif spec.vendor == "nvidia":
        container.append(("AddDevice", NVIDIA_CDI))
        findings.append(Finding(
            "info", "export-nvidia-cdi", f"the unit asks Podman for {NVIDIA_CDI} (CDI)",
            key="GPU_VENDOR", fix="once per host: nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml"))
    volumes = [(paths.hf_cache, spec.layout.mounts[HF_CACHE], False),
               (paths.engine_cache, spec.layout.mounts[ENGINE_CACHE], False),
               *((f.source, f.target, f.read_only) for f in spec.folders)]
    if spec.models_dir:
        volumes.append((Path(spec.models_dir).expanduser(), str(Path(spec.models_dir).expanduser()),
                        True))
    for source, target, read_only in volumes:
        if ":" in str(source) or ":" in target:
            findings.append(Finding("error", "export-volume-colon",
                                    f"{source} holds ':', which Quadlet's Volume= splits on",
                                    fix="move the folder to a path without ':'"))
        container.append(("Volume", systemd_literal(f"{source}:{target}" + (":ro" if read_only
                                                                             else ""))))
    container += [("Environment", unit_word(systemd_literal(f"{k}={v}")))
                  for k, v in spec.env.items()]
    labels = {"vllmstack.profile": spec.profile, "vllmstack.platform": spec.platform,
              "vllmstack.argv": json.dumps(spec.argv)}
    container += [("Label", unit_word(systemd_literal(f"{k}={v}"))) for k, v in labels.items()]
    container += [("Annotation", unit_word(systemd_literal(f"{k}={v}")))
                  for k, v in describe(spec).items() if k not in ("vllmstack/argv",)]
    shm = shm_flag(spec.setting("EXPORT_SHM_SIZE"))
    if shm is None:
        findings.append(Finding("error", "export-shm-size",
                                f"EXPORT_SHM_SIZE={spec.setting('EXPORT_SHM_SIZE')} is not a size "
                                "in Mi or Gi", key="EXPORT_SHM_SIZE",
                                source=resolved.source("EXPORT_SHM_SIZE"), fix="e.g. 20Gi"))
    else:
        podman.append(["--shm-size", shm])
    health = spec.layout.health
    podman.append(["--health-cmd", json.dumps(health.command(spec.port)),
                   "--health-interval", f"{health.interval}s", "--health-timeout",
                   f"{health.timeout}s", "--health-retries", str(health.retries),
                   "--health-start-period", f"{resolved.get_int('UP_TIMEOUT')}s"])
    podman.append(["--stop-timeout", str(spec.layout.stop_grace)])
    secret_store = spec.setting("EXPORT_SECRET")
    flag_secrets = [s for s in spec.secrets if s.in_argv]
    for secret in spec.secrets:
        if secret.in_argv:
            continue
        podman.append(["--secret", f"{secret_store}-{secret.key},type=env,target={secret.name}"])
        findings.append(Finding(
            "info", "export-secret-reference", f"{secret.name} ({secret.origin}) comes from the "
            f"Podman secret {secret_store}-{secret.key}; its value is not exported",
            key=secret.name, fix=f"printf %s VALUE | podman secret create {secret_store}-{secret.key} -"))
    container += [("PodmanArgs", words(args)) for args in podman]
    findings += control_characters(resolved, container)
    service = [("Restart", "always"), ("TimeoutStartSec", str(START_TIMEOUT))]
    if flag_secrets:
        env_file = f"%E/vllmstack/{name}.secrets.env"
        service.append(("EnvironmentFile", env_file))
        findings.append(Finding(
            "info", "export-secret-reference",
            f"{'; '.join(s.origin for s in flag_secrets)}: from {env_file} (%E is /etc for a "
            "system unit, ~/.config for a user unit); not exported",
            fix="write " + ", ".join(f"{s.name}=VALUE" for s in flag_secrets) + " into it (chmod 600)"))
    return container, service, findings


def control_characters(resolved: Resolved, entries: list[tuple[str, str]]) -> list[Finding]:
    """A unit file is read line by line: a newline in a value would start a line of the writer's
    choosing (`PodmanArgs=--privileged`, `Volume=/:/host`), and other control characters have no
    place in one. Every value the unit would hold is checked, whatever built it; the setting that
    carried the character is named with its file:line (a path derived from $HOME has none)."""
    found: list[Finding] = []
    named: set[str] = set()
    for unit_key, value in entries:
        if not CONTROL.search(value):
            continue
        settings: list[Setting | None] = [
            s for s in resolved.values.values() if CONTROL.search(s.value)
            and any(part and part in value for part in CONTROL.split(s.value))]
        for setting in settings or [None]:
            key = setting.key if setting is not None else unit_key
            if key in named:
                continue
            named.add(key)
            found.append(Finding(
                "error", "export-control-character",
                f"{key} holds a control character ({repr(setting.value if setting else value)[:80]}), "
                f"which would reach the unit's {unit_key}= line; in a unit file a newline starts "
                "a line of its own (another key, e.g. PodmanArgs=--privileged)",
                key=setting.key if setting is not None else None,
                source=setting.source if setting is not None else None,
                fix=f"remove the newline or control character from {key}"))
    return found


def _text(spec: EngineSpec, name: str, container: list[tuple[str, str]],
          service: list[tuple[str, str]]) -> str:
    lines = [
        f"# Written by `invoke export --to quadlet` for profile {spec.profile} on {spec.platform}.",
        "# Podman >= 4.4. Install it as a system unit (or in ~/.config/containers/systemd/ for a",
        "# user unit) and start the service Quadlet generates from it:",
        f"#   sudo cp {name}.container /etc/containers/systemd/",
        f"#   sudo systemctl daemon-reload && sudo systemctl start {name}.service",
        "# Keys newer than Podman 4.4 are written as the podman run flags in PodmanArgs=.",
        "",
        "[Unit]",
        f"Description=vllmstack engine {spec.profile} on {spec.platform} ({spec.engine})",
        "Wants=network-online.target",
        "After=network-online.target",
        "",
        "[Container]",
        *(f"{k}={v}" for k, v in container),
        "",
        "[Service]",
        *(f"{k}={v}" for k, v in service),
        "",
        "[Install]",
        "WantedBy=multi-user.target default.target",
        "",
    ]
    return "\n".join(lines)
