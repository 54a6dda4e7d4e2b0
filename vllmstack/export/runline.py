"""The engine as one `podman run` line: the Quadlet unit's container (quadlet.unit_entries, the
compose service key by key) written as the flags `podman run` takes for each key, for a host
that runs containers by hand or from its own scheduler (llm-d without Kubernetes).

Quadlet turns each [Container] key into the `podman run` flag of the same meaning (ContainerName
--name, User/Group --user, PublishPort --publish, AddDevice --device, Volume --volume,
Environment --env, Label --label, Annotation --annotation, PodmanArgs as they are, Image and Exec
last), so the line runs the same container. The unit's values are systemd's (quoted words, `$$`
and `%%` for a literal `$` and `%`, `${VAR}` for a secret the unit's EnvironmentFile fills); here
each word is shell-quoted, and a secret is "${VAR}" from the caller's environment.
"""

from __future__ import annotations

import re
import shlex

from vllmstack.export.validate import unit_words

FLAGS = {"ContainerName": "--name", "PublishPort": "--publish", "AddDevice": "--device",
         "Volume": "--volume", "Environment": "--env", "Label": "--label",
         "Annotation": "--annotation"}
SYSTEMD_TOKEN = re.compile(r"(\$\$|%%|\$\{[A-Za-z_][A-Za-z0-9_]*\})")


def shell_word(unit_word: str) -> str:
    """One word of a unit value (already split) as a shell word: literal text quoted, `${VAR}`
    left for the shell to expand inside double quotes."""
    out: list[str] = []
    for token in SYSTEMD_TOKEN.split(unit_word):
        if not token:
            continue
        if token == "$$":
            out.append(shlex.quote("$"))
        elif token == "%%":
            out.append(shlex.quote("%"))
        elif token.startswith("${"):
            out.append(f'"{token}"')
        else:
            out.append(shlex.quote(token))
    return "".join(out) or "''"


def run_words(container: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """`podman run -d --replace ...` as shell words, from the unit's [Container] entries: the
    options, and the command (the image, then the argv after its entrypoint)."""
    entries = dict(container)
    words = ["podman", "run", "-d", "--replace"]
    user = [entries[k] for k in ("User", "Group") if k in entries]
    if user:
        words += ["--user", shell_word(":".join(user))]
    for key, value in container:
        if key in FLAGS:
            words += [FLAGS[key], *(shell_word(w) for w in unit_words(value))]
        elif key == "PodmanArgs":
            words += [shell_word(w) for w in unit_words(value)]
    command = [shell_word(unit_words(entries["Image"])[0]),
               *(shell_word(w) for w in unit_words(entries.get("Exec", "")))]
    return words, command


def run_script(title: str, options: list[str], command: list[str]) -> str:
    """A POSIX sh script of the line: one option per line, the image on its own, then the
    engine's flags one per line."""
    lines = [" ".join(options[:2])]
    for words in (options[2:], command):
        current: list[str] = []
        for word in words:
            if current and (word.startswith("--") or word == "-d"):
                lines.append(" ".join(current))
                current = []
            current.append(word)
            if words is command and len(current) == 1 and word == command[0]:
                lines.append(word)
                current = []
        if current:
            lines.append(" ".join(current))
    return "#!/bin/sh\n" + title + "set -eu\n" + " \\\n  ".join(lines) + "\n"


def command_of(script: str, image: str) -> list[str]:
    """The words after the image in a script run_script wrote, as sh reads them (a secret as
    its `${VAR}` text): what the container runs after the image's entrypoint."""
    body = script.split("set -eu\n", 1)[1].replace("\\\n", " ")
    words = shlex.split(body)
    return words[words.index(image) + 1:]
