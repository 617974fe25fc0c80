# Sourced by .ci/oldest.sh and .ci/newest.sh: `overlay_venv DIR [venv options]` makes a venv at DIR that sees the
# packages of "$PY" (torch and the rest are not installed twice) behind its own. `--system-site-packages` would not do:
# run from inside an activated venv (as in a fresh-venv CI), it shows the base interpreter's packages, not the venv's.
overlay_venv() {
  local dir=$1; shift
  "$PY" -m venv --clear "$@" "$dir"
  "$PY" -c 'import sysconfig; print("\n".join(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))))' \
    > "$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_ndparallel_parent.pth"
}
