#!/usr/bin/env bash
# embed_check.sh SOURCE BUILD: libmoe as an embedder takes it. libmoe.so
# exports exactly moe.h's functions; moe.h compiles alone as C99, C11,
# C++98 and C++11 under -pedantic -Werror; `cmake --install` gives the
# library, the header, moe.pc and moe-static.pc, through which
# tests/embed/embed.c builds against the shared and the static library with
# nothing but pkg-config's flags, runs, and loads the OpenBLAS the build
# linked.
set -euo pipefail
src=$1 build=$2
extra=${EMBED_CFLAGS:-} # the library's sanitizers, when it has them
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

declared=$(grep -oE '^[a-z].*[ *](moe_[a-z0-9_]+)\(' "$src/include/moe.h" | grep -oE 'moe_[a-z0-9_]+\($' | tr -d '(' | sort)
exported=$(nm -D --defined-only "$build/libmoe.so" | awk '$2 ~ /^[A-Z]$/ && $2 != "A" {print $3}' | sed 's/@.*//' | sort)
if [ "$declared" != "$exported" ]; then
    echo "libmoe.so's exports differ from moe.h's functions (< moe.h, > libmoe.so):"
    diff <(echo "$declared") <(echo "$exported") | head -20
    exit 1
fi
echo "exports: the $(echo "$declared" | wc -l) functions of moe.h, nothing else"

for std in c99 c11; do cc -std=$std -Wall -Wextra -pedantic -Werror -fsyntax-only -x c "$src/include/moe.h"; done
for std in c++98 c++11; do c++ -std=$std -Wall -Wextra -pedantic -Werror -fsyntax-only -x c++ "$src/include/moe.h"; done
echo "moe.h: C99, C11, C++98, C++11 -pedantic -Werror"

cmake --install "$build" --prefix "$work/prefix" > /dev/null
pc=$(find "$work/prefix" -name moe.pc)
[ -n "$pc" ] && [ -f "$work/prefix/include/moe.h" ] || { echo "cmake --install gave no moe.pc or include/moe.h"; exit 1; }
export PKG_CONFIG_PATH=$(dirname "$pc")
# The OpenBLAS a program loads: the one the build linked, not the one
# update-alternatives selects.
openblas_of() { ldd "$1" | awk '$1 ~ /^libopenblas/ {print $3}'; }
want=$(openblas_of "$build/libmoe.so")
cc -std=c99 -Wall -Wextra -pedantic -Werror $extra "$src/tests/embed/embed.c" -o "$work/embed_shared" \
    $(pkg-config --cflags --libs moe) -lm
readelf -d "$work/embed_shared" | grep -q 'NEEDED.*libmoe.so.0' || { echo "not linked to libmoe.so.0"; exit 1; }
"$work/embed_shared"
cc -std=c99 -Wall -Wextra -pedantic -Werror $extra "$src/tests/embed/embed.c" -o "$work/embed_static" \
    $(pkg-config --cflags --libs moe-static)
if readelf -d "$work/embed_static" | grep -q 'NEEDED.*libmoe'; then echo "moe-static linked a shared libmoe"; exit 1; fi
"$work/embed_static"
for program in embed_shared embed_static; do
    got=$(openblas_of "$work/$program")
    [ "$got" = "$want" ] || { echo "$program loads OpenBLAS from $got, the build from $want"; exit 1; }
done
echo "installed: both programs run, and load the build's OpenBLAS ($want)"
