# Sourced by scripts/test and .ci/run: the programs the browser and terminal tests drive
# (chromium, chromium-driver, tmux). Installed with apt-get when missing and this user may;
# otherwise those tests skip and say how to install them.
missing=()
command -v chromium >/dev/null || missing+=(chromium)
command -v chromedriver >/dev/null || missing+=(chromium-driver)
command -v tmux >/dev/null || missing+=(tmux)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
  else
    echo "not installed: ${missing[*]}; their tests will skip." \
      "Install with: sudo apt-get install -y ${missing[*]}" >&2
  fi
fi
