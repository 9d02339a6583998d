"""``cronbus completion bash|zsh``: a completion script written from the parser itself, so it
knows every subcommand, option and choice the command has, and never falls behind it.

bash: ``source <(cronbus completion bash)``; zsh: ``source <(cronbus completion zsh)`` (it loads
zsh's bash-compatible completion and uses the same function).
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Iterator

SHELLS = ("bash", "zsh")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _walk(
    parser: argparse.ArgumentParser, path: str
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for name, child in _subparsers(parser).items():
        yield from _walk(child, f"{path} {name}")


def _words(parser: argparse.ArgumentParser) -> list[str]:
    """What may come next at this level: subcommands, option flags, a positional's choices."""
    words = list(_subparsers(parser))
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        if action.option_strings:
            words += [flag for flag in action.option_strings if flag.startswith("--")]
            words += [flag for flag in action.option_strings if not flag.startswith("--")]
        elif action.choices is not None:
            words += [str(choice) for choice in action.choices]
    return words


def _values(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str]]:
    """(flag, its choices) for the options that take one of a few values; ``-f`` takes files."""
    for action in parser._actions:
        for flag in action.option_strings:
            if action.choices is not None:
                yield flag, " ".join(str(choice) for choice in action.choices)
            elif flag in ("-f", "--file"):
                yield flag, "@files"


def bash(parser: argparse.ArgumentParser) -> str:
    words: list[str] = []
    values: list[str] = []
    for path, node in _walk(parser, "cronbus"):
        words.append(f"    [{shlex.quote(path)}]={shlex.quote(' '.join(_words(node)))}")
        values += [
            f"    [{shlex.quote(path + '|' + flag)}]={shlex.quote(choices)}"
            for flag, choices in _values(node)
        ]
    return "\n".join(
        [
            "# cronbus completion for bash: source <(cronbus completion bash)",
            "declare -gA _cronbus_words=(",
            *words,
            ")",
            "declare -gA _cronbus_values=(",
            *values,
            ")",
            "_cronbus() {",
            '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}"',
            "    local path=cronbus i",
            "    # The deepest subcommand named so far decides what comes next.",
            "    for ((i = 1; i < COMP_CWORD; i++)); do",
            '        if [[ -n "${_cronbus_words[$path ${COMP_WORDS[i]}]+set}" ]]; then',
            '            path="$path ${COMP_WORDS[i]}"',
            "        fi",
            "    done",
            '    local values="${_cronbus_values[$path|$prev]-}"',
            '    if [[ "$values" == "@files" ]]; then',
            '        COMPREPLY=($(compgen -f -- "$cur"))',
            '    elif [[ -n "$values" ]]; then',
            '        COMPREPLY=($(compgen -W "$values" -- "$cur"))',
            "    else",
            '        COMPREPLY=($(compgen -W "${_cronbus_words[$path]}" -- "$cur"))',
            "    fi",
            "}",
            "complete -o default -F _cronbus cronbus",
        ]
    )


def zsh(parser: argparse.ArgumentParser) -> str:
    return "\n".join(
        [
            "# cronbus completion for zsh: source <(cronbus completion zsh)",
            "autoload -U +X compinit && compinit",
            "autoload -U +X bashcompinit && bashcompinit",
            bash(parser).split("\n", 1)[1],
        ]
    )


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    return bash(parser) if shell == "bash" else zsh(parser)
