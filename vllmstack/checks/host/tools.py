"""The host's tools: which container runtimes answer and which one `up` picks, Docker with
buildx, the NVIDIA driver and its container toolkit.

The runtime choice is the runtime layer's own: `requested_runtime` (RUNTIME, --runtime, what the
last `up` used) and `detect_compose` (the order Compose v2, Compose v1, Podman), asked once per
runtime through a memoised runner, so the report can never disagree with what `up` does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllmstack.checks.host.model import FAIL, PASS, SKIP, WARN, HostCheck, HostView
from vllmstack.config.profiles import Resolved
from vllmstack.core.runner import Result
from vllmstack.runtime import flavours
from vllmstack.runtime.compose import ComposeCli, ComposeError, detect_compose
from vllmstack.runtime.select import requested_runtime

# docker 23 made `docker build` with BuildKit a call into the buildx plugin; 20.10 has BuildKit
# built in. Measured: docker 28.2.2 without the plugin stops `DOCKER_BUILDKIT=1 docker build` with
# "BuildKit is enabled but the buildx component is missing or broken"; 20.10.24 builds.
BUILDX_REQUIRED_FROM = 23
CDI_DIRS = ("/etc/cdi", "/var/run/cdi")
NVIDIA_QUERY = "index,name,compute_cap,driver_version,memory.total"


@dataclass
class ViewRunner:
    """A Runner over the view: every query memoised, so the runtime layer's detection can be
    asked once per runtime without running each `version` again."""

    view: HostView
    dry_run: bool = False

    def run(self, argv: Sequence[str], *, capture: bool = True, check: bool = False,
            env: Mapping[str, str] | None = None, cwd: Path | None = None,
            input_text: str | None = None, timeout: float | None = None, mutates: bool = True,
            merge_output: bool = False) -> Result:
        return self.view.run(*(str(a) for a in argv), timeout=timeout or 20)


def _first_line(result: Result) -> str:
    lines = (result.stdout or result.stderr).strip().splitlines()
    return lines[0].strip() if lines else ""


def _version_line(result: Result) -> str:
    """The compose's own version line (podman-compose prints podman's first)."""
    lines = [ln.strip() for ln in (result.stdout + "\n" + result.stderr).splitlines()]
    own = [ln for ln in lines if re.search(r"compose\S*\s+version\s+v?\d", ln, re.IGNORECASE)]
    return " ".join((own[0] if own else _first_line(result)).split())


def _last_line(result: Result) -> str:
    lines = (result.stderr or result.stdout).strip().splitlines()
    return lines[-1].strip() if lines else f"exit {result.returncode}"


@dataclass(frozen=True)
class RuntimeChoice:
    picked: str | None  # compose | compose-v1 | podman | native; None: nothing usable
    reason: str
    cli: ComposeCli | None = None
    error: ComposeError | None = None


def runtime_choice(view: HostView, resolved: Resolved, previous: Mapping[str, Any],
                   runtime: str | None) -> tuple[dict[str, dict[str, Any]], RuntimeChoice]:
    """Which compose runtimes answer, and the one `up` would use with the reason."""
    runner = ViewRunner(view)
    docker = resolved.get_str("DOCKER")
    present: dict[str, dict[str, Any]] = {}
    for name in flavours.FLAVOURS:
        try:
            cli = detect_compose(runner, docker, name)
        except ComposeError:
            present[name] = {"present": False, "command": None, "version": None}
            continue
        present[name] = {"present": True, "command": " ".join(cli.base),
                         "version": _version_line(runner.run([*cli.base, "version"]))}
    requested = requested_runtime(resolved, runtime, previous)
    configured = resolved.get_str("RUNTIME")
    if runtime:
        why = f"--runtime {runtime}"
    elif previous.get("runtime") and configured == "auto":
        why = (f"RUNTIME=auto and the last `up` here used {requested} (generated/state.json): "
               "up, down and status keep to it until `invoke down`")
    elif configured != "auto":
        why = f"RUNTIME={configured} (at {resolved.source('RUNTIME')})"
    else:
        why = ("RUNTIME=auto: the first of " + ", ".join(present) + " whose `version` answers")
    if requested == "native":
        return present, RuntimeChoice("native", why)
    try:
        cli = detect_compose(runner, docker, requested)
    except ComposeError as exc:
        return present, RuntimeChoice(None, why, error=exc)
    if requested == "auto":
        before = list(present)[:list(present).index(cli.runtime)]
        why += f" ({', '.join(before)} did not)" if before else ""
    return present, RuntimeChoice(cli.runtime, why, cli)


def check_runtimes(present: dict[str, dict[str, Any]], choice: RuntimeChoice) -> HostCheck:
    listed = "; ".join(f"{name}: {info['version'] or info['command']}" if info["present"]
                       else f"{name}: absent" for name, info in present.items())
    data = {"picked": choice.picked, "reason": choice.reason, "present": present}
    if choice.picked is None:
        error = choice.error
        return HostCheck("runtimes", "container runtimes", FAIL,
                         f"{error.cause if error else 'no runtime'} [{listed}]; chosen by "
                         f"{choice.reason}", error.fix if error else None, data)
    how = f"{choice.picked} ({' '.join(choice.cli.base)})" if choice.cli else choice.picked
    return HostCheck("runtimes", "container runtimes", PASS,
                     f"up uses {how}, because {choice.reason} [{listed}]", data=data)


def check_docker(view: HostView, resolved: Resolved, choice: RuntimeChoice) -> HostCheck:
    docker = resolved.get_str("DOCKER")
    # Needed when the picked compose drives the docker engine, or when nothing was picked.
    needed = choice.cli.engine == docker if choice.cli else choice.picked != "native"
    picked = choice.picked
    title = "docker and buildx"
    result = view.run(docker, "version", "--format", "{{.Client.Version}}|{{.Server.Version}}")
    client, _, server = result.stdout.strip().partition("|")
    data: dict[str, Any] = {"docker": docker, "client": client or None, "server": server or None,
                            "buildx": None}
    if result.returncode == 127 or not client:
        return HostCheck("docker", title, FAIL if needed else SKIP,
                         f"no docker client ({docker})" + ("" if needed else
                                                          f": not needed, up uses {picked}"),
                         "install Docker Engine with the compose plugin (or Podman), or run "
                         "the engine as a process: --runtime native", data)
    problems: list[tuple[str, str, str]] = []  # (status, what, fix)
    if not result.ok or not server:
        denied = "permission denied" in (result.stderr or "").lower()
        fix = (f"sudo usermod -aG docker {view.user.name}, then log out and back in" if denied
               else "start it: sudo systemctl start docker")
        problems.append((FAIL if needed else WARN,
                         f"docker {client} cannot reach its engine: {_last_line(result)}", fix))
    buildx = view.run(docker, "buildx", "version")
    if buildx.ok:
        data["buildx"] = _first_line(buildx)
        builder = f"buildx {data['buildx']}"
    else:
        major = re.match(r"\d+", client)
        if major and int(major.group()) >= BUILDX_REQUIRED_FROM:
            problems.append((WARN, f"docker {client} has no buildx plugin, and from docker "
                             f"{BUILDX_REQUIRED_FROM} on `invoke build` (DOCKER_BUILDKIT=1 docker "
                             "build) stops with \"BuildKit is enabled but the buildx component is "
                             "missing or broken\"",
                             "install the plugin (Debian/Ubuntu: apt install docker-buildx; "
                             "Docker's repository: docker-buildx-plugin), or set DOCKER to a "
                             "client with BuildKit built in (docker 20.10)"))
            builder = "no buildx"
        else:
            builder = f"BuildKit built into docker {client} (no buildx needed)"
    if problems:
        status = FAIL if any(p[0] == FAIL for p in problems) else WARN
        return HostCheck("docker", title, status, "; ".join(p[1] for p in problems),
                         "; ".join(p[2] for p in problems), data)
    return HostCheck("docker", title, PASS, f"docker client {client}, engine {server}; {builder}",
                     data=data)


def check_nvidia_driver(view: HostView, vendor: str) -> HostCheck:
    title = "NVIDIA driver"
    if vendor != "nvidia":
        return HostCheck("nvidia-driver", title, SKIP, f"GPU_VENDOR={vendor}")
    fmt = "--format=csv,noheader,nounits"
    result = view.run("nvidia-smi", f"--query-gpu={NVIDIA_QUERY}", fmt)
    if not result.ok and result.returncode != 127:  # a driver too old to know compute_cap
        result = view.run("nvidia-smi", "--query-gpu=index,name,driver_version,memory.total", fmt)
    if result.returncode == 127:
        return HostCheck("nvidia-driver", title, FAIL, "nvidia-smi not found: no NVIDIA driver",
                         "install the NVIDIA driver (Ubuntu: sudo ubuntu-drivers install) and "
                         "reboot")
    if not result.ok:
        return HostCheck("nvidia-driver", title, FAIL, f"nvidia-smi failed: {_last_line(result)}",
                         "the driver does not answer: reboot after a driver update, or reinstall "
                         "the driver for this kernel (dmesg | grep -i nvidia says why)")
    rows = [[f.strip() for f in line.split(",")] for line in result.stdout.strip().splitlines()]
    rows = [r for r in rows if len(r) >= 4 and r[0].isdigit()]
    driver = rows[0][-2] if rows else "?"
    caps = sorted({r[2] for r in rows if len(r) == 5})
    names = sorted({r[1] for r in rows})
    data = {"driver": driver, "gpus": len(rows), "compute_capability": caps}
    cap_text = f" (compute capability {', '.join(caps)})" if caps else ""
    return HostCheck("nvidia-driver", title, PASS,
                     f"driver {driver}; {len(rows)} × {', '.join(names)}{cap_text}", data=data)


def cdi_specs(view: HostView) -> list[str]:
    """CDI spec files that describe NVIDIA GPUs (kind nvidia.com/gpu)."""
    found = []
    for folder in CDI_DIRS:
        path = view.path(folder)
        if not path.is_dir():
            continue
        for spec in sorted(path.iterdir()):
            if spec.suffix in (".yaml", ".yml", ".json") and "nvidia.com/gpu" in (
                    view.read(f"{folder}/{spec.name}") or ""):
                found.append(f"{folder}/{spec.name}")
    return found


def check_nvidia_toolkit(view: HostView, vendor: str, picked: str | None) -> HostCheck:
    title = "NVIDIA container toolkit"
    if vendor != "nvidia":
        return HostCheck("nvidia-toolkit", title, SKIP, f"GPU_VENDOR={vendor}")
    if picked == "native":
        return HostCheck("nvidia-toolkit", title, SKIP, "up runs the engine as a process on the "
                         "host's driver: no container toolkit needed")
    flavour = flavours.FLAVOURS.get(picked or "")
    cdi = flavour is not None and flavour.nvidia == "cdi"
    ctk = view.run("nvidia-ctk", "--version")
    specs = cdi_specs(view)
    data = {"nvidia_ctk": _first_line(ctk) if ctk.ok else None, "cdi_specs": specs,
            "needs_cdi": cdi}
    generate = "sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml"
    if not ctk.ok:
        then = (generate if cdi else "sudo nvidia-ctk runtime configure --runtime=docker && "
                "sudo systemctl restart docker")
        return HostCheck("nvidia-toolkit", title, FAIL, "nvidia-ctk not found: containers cannot "
                         "reach the GPUs without the NVIDIA Container Toolkit",
                         f"install nvidia-container-toolkit, then {then}", data)
    if cdi and not specs:
        return HostCheck("nvidia-toolkit", title, FAIL,
                         f"{picked} reaches NVIDIA GPUs through CDI (nvidia.com/gpu=all) and no CDI "
                         f"spec names them in {' or '.join(CDI_DIRS)}", generate, data)
    spec_text = ", ".join(specs) if specs else "no CDI spec (Docker's GPU reservation needs none)"
    return HostCheck("nvidia-toolkit", title, PASS, f"{data['nvidia_ctk']}; {spec_text}", data=data)
