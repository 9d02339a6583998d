# Sourced by the other scripts: creates or reuses .venv and installs cronbus with its
# development and documentation extras whenever pyproject.toml changed since the last successful
# install.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv"
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV" || { echo "could not create $VENV" >&2; exit 1; }
fi
stamp="$VENV/.cronbus-installed"
want=$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "installing cronbus and its dependencies into .venv ..." >&2
  rm -f "$stamp"
  if ! "$VENV/bin/python" -m pip install -q --upgrade pip \
      || ! "$VENV/bin/python" -m pip install -q -e "$ROOT[dev,docs]"; then
    echo "installing cronbus into .venv failed (see above)" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
