# The CPython versions the package declares (pyproject.toml's classifiers) and the suite runs
# on, newest first: the newest runs everything (.venv), the oldest the library-facing suites
# on the lowest declared libraries (.venv-floors), each one between them the same suites on
# the newest libraries (.venv-<version>). tests/test_packaging.py checks the classifiers
# against this list. Sourced by scripts/test, scripts/test-floors and scripts/test-python.
PYTHONS=(3.13 3.12 3.11)

# The interpreter of CPython $1 (e.g. 3.12): $PYTHON<major><minor> if set (PYTHON312=...),
# else python$1 on PATH, else pyenv's build of it, else Debian's /usr/bin/python$1. Prints
# nothing when there is none.
find_python() {
  local version=$1 var="PYTHON${1/./}" candidate
  for candidate in "${!var:-}" "$(command -v "python$version" 2>/dev/null || true)" \
      $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version".*/bin/"python$version" 2>/dev/null | sort -V -r) \
      "/usr/bin/python$version"; do
    [ -n "$candidate" ] && [ -x "$candidate" ] || continue
    # A pyenv shim is on PATH even where that version is not selected: ask it to run.
    if "$candidate" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$version'.split('.'))))" 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  return 0
}

# find_python, or stop with what to do.
need_python() {
  local found
  found=$(find_python "$1")
  if [ -z "$found" ]; then
    echo "scripts: CPython $1 is not on this machine, and the suite runs on ${PYTHONS[*]}:" >&2
    echo "  install it (pyenv install $1, or your system's python$1) or name it: PYTHON${1/./}=/path/to/python$1" >&2
    exit 1
  fi
  echo "$found"
}
