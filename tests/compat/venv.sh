#!/usr/bin/env bash
# Build (once) the venv of `make test-compat`: a given torch release, the torchvision made for
# it, and the project with its lab and test extras.
#   usage: bash tests/compat/venv.sh PYTHON TORCH VENV      e.g. ... python3 2.6.0 .venv-compat-2.6.0
# torchvision 0.(minor+15) goes with torch 2.minor (2.6 -> 0.21, 2.14 -> 0.29); pip picks the
# newest torchvision below 0.(minor+16) that accepts the pinned torch, or set TORCHVISION=x.y.z.
# Some machines cap torch in a pip constraints file named in pip's configuration: the cap is
# lifted for this one install (PIP_CONSTRAINT=/dev/null), never for the project's own .venv.
#   TORCH=latest: whatever release PyPI serves today (make test-newest), found with pip itself.
set -euo pipefail
python=$1 torch=$2 venv=$3
if [ "$torch" = latest ]; then
    torch=$(PIP_CONSTRAINT=/dev/null "$python" -m pip index versions torch 2>/dev/null \
            | sed -n 's/^torch (\([0-9.]*\))$/\1/p')
    [ -n "$torch" ] || { echo "pip could not tell the newest torch release" >&2; exit 1; }
    echo "the newest torch release is $torch"
fi
IFS=. read -r major minor _patch <<<"$torch"
if [ "$major" != 2 ] || ! [ "${minor:-x}" -ge 0 ] 2>/dev/null; then
    echo "TORCH=$torch: give a torch 2.x release, such as TORCH=2.6.0" >&2
    exit 2
fi
vision=${TORCHVISION:+torchvision==$TORCHVISION}
vision=${vision:-torchvision<0.$((minor + 16))}
stamp=$venv/.ddplab-installed
want="torch==$torch $vision pyproject:$(sha1sum pyproject.toml | cut -c1-12)"
if [ -f "$stamp" ] && [ "$(head -n1 "$stamp")" = "$want" ]; then
    exit 0
fi
echo "building $venv with torch $torch ($vision); its CUDA wheels are a few GB"
test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q \
    "torch==$torch" "$vision" -e '.[lab,test]'
installed=$("$venv/bin/python" -c '
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in ("torch", "torchvision")))')
case " $installed" in
    *" torch==$torch"[+\ ]* | *" torch==$torch") ;;
    *) echo "pip installed $installed, not torch $torch: see the pip output above" >&2
       exit 1 ;;
esac
printf '%s\n%s\n' "$want" "$installed" >"$stamp"
echo "$venv: $installed"
