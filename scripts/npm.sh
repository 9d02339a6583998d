# Sourced by scripts/test: the npm projects CI runs (tools/asyncapi: the AsyncAPI CLI that
# validates docs/asyncapi.yaml; examples/node: the Node.js client tested end to end), each
# installed with `npm ci` from its lock file, again only when the lock file changed.
if command -v npm >/dev/null; then
  for project in tools/asyncapi examples/node; do
    if [ ! "$project/node_modules/.package-lock.json" -nt "$project/package-lock.json" ]; then
      (cd "$project" && npm ci --no-audit --no-fund --loglevel=error)
    fi
  done
elif [ "${CRONBUS_TEST_REQUIRE_TOOLS:-}" = 1 ]; then
  echo "npm not installed: CI needs it (sudo apt-get install -y nodejs npm)" >&2
  exit 1
else
  echo "npm not installed: the AsyncAPI check and the Node.js example will skip." \
    "Install with: sudo apt-get install -y nodejs npm" >&2
fi
