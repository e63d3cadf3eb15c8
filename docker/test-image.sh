#!/usr/bin/env bash
# shellcheck disable=SC2317  # the step functions are called by name ("step_$step")
# Build the CPU image from docker/Dockerfile and smoke-test it: rapidlite --help, rapidlite env, a 2-process
# pretraining run, the fine-tuning demo, a --torch-compile run and a DeepSpeed run (when the image has that extra).
# Prints how long the build and each step took; exits 0 only when every step passed. Settings (environment
# variables):
#
#   IMAGE          tag to build                      (default rapidlite:<version>-cpu)
#   BASE_IMAGE     base of both stages               (default python:3.11-slim)
#   TORCH_WHEELS   a directory holding the torch wheel: served on 127.0.0.1 during the build, which then uses the
#                  host's network (default: none, torch comes from TORCH_INDEX)
#   TORCH_INDEX    index torch is installed from     (default https://download.pytorch.org/whl/cpu)
#   TORCH_VERSION  torch version                     (default the Dockerfile's)
#   CA_CERTS       a PEM file or a directory of *.crt/*.pem files trusted during the build
#                  (default the host's /usr/local/share/ca-certificates/*.crt; empty for none)
#   EXTRAS         rapidlite extras in the image     (default the Dockerfile's: deepspeed)
#   DOCKER_BUILD_ARGS  more arguments for docker build (e.g. "--build-arg PIP_INDEX_URL=...")
#
# The runs in the container have no network (--network none): the demo and the embedded corpus need none.
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")

die() {
    echo "test-image.sh: $*" >&2
    exit 2
}

command -v docker >/dev/null || die "the docker command is missing: install Docker"
docker info >/dev/null 2>&1 || die "no Docker daemon answers (docker info failed): start it, or set DOCKER_HOST"
version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$repo/rapidlite/__init__.py")
[ -n "$version" ] || die "no __version__ in $repo/rapidlite/__init__.py"

IMAGE=${IMAGE:-rapidlite:$version-cpu}
BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
build_args=(--build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "TORCH_INDEX=$TORCH_INDEX")
[ -n "${TORCH_VERSION:-}" ] && build_args+=(--build-arg "TORCH_VERSION=$TORCH_VERSION")
[ -n "${EXTRAS+set}" ] && build_args+=(--build-arg "EXTRAS=$EXTRAS")

# Extra CA certificates: the host's local ones unless told otherwise.
if [ -z "${CA_CERTS+set}" ]; then
    CA_CERTS=/usr/local/share/ca-certificates
    [ -d "$CA_CERTS" ] || CA_CERTS=""
fi
if [ -n "$CA_CERTS" ]; then
    if [ -d "$CA_CERTS" ]; then
        pem=$(find "$CA_CERTS" -maxdepth 1 -type f \( -name '*.crt' -o -name '*.pem' \) -exec cat {} +)
    elif [ -f "$CA_CERTS" ]; then
        pem=$(cat "$CA_CERTS")
    else
        die "CA_CERTS=$CA_CERTS is neither a file nor a directory"
    fi
    if [ -n "$pem" ]; then
        grep -q -- '-----BEGIN CERTIFICATE-----' <<<"$pem" || die "CA_CERTS=$CA_CERTS holds no PEM certificate"
        build_args+=(--build-arg "EXTRA_CA_CERTS=$pem")
    fi
fi

server_pid=""
volume=""
cleanup() {
    [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null
    [ -n "$volume" ] && docker volume rm -f "$volume" >/dev/null 2>&1
}
trap cleanup EXIT

# A local torch wheel directory, served on loopback for the build (which then shares the host's network).
network_args=()
if [ -n "${TORCH_WHEELS:-}" ]; then
    [ -d "$TORCH_WHEELS" ] || die "TORCH_WHEELS=$TORCH_WHEELS is not a directory"
    compgen -G "$TORCH_WHEELS/torch-*.whl" >/dev/null || die "TORCH_WHEELS=$TORCH_WHEELS holds no torch-*.whl"
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    python3 -m http.server --bind 127.0.0.1 --directory "$TORCH_WHEELS" "$port" >/dev/null 2>&1 &
    server_pid=$!
    for _ in $(seq 50); do
        python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/')" 2>/dev/null && break
        sleep 0.1
    done
    build_args+=(--build-arg "TORCH_FIND_LINKS=http://127.0.0.1:$port/")
    network_args=(--network host)
fi
# shellcheck disable=SC2206  # word splitting is what DOCKER_BUILD_ARGS is for
extra_build_args=(${DOCKER_BUILD_ARGS:-})

names=()
seconds=()
results=()
failed=0
now() { date +%s.%N; }
record() { # name start status
    names+=("$1")
    seconds+=("$(awk -v a="$2" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')")
    if [ "$3" -eq 0 ]; then results+=(ok); else results+=(FAILED); failed=1; fi
    echo "=== $1: ${results[-1]} in ${seconds[-1]} s"
}
summary() {
    echo
    echo "image $IMAGE (rapidlite $version, base $BASE_IMAGE): $(docker image ls --format '{{.Size}}' "$IMAGE" 2>/dev/null)"
    for i in "${!names[@]}"; do printf '  %-12s %-7s %8s s\n' "${names[$i]}" "${results[$i]}" "${seconds[$i]}"; done
}
fail() { # ends the step (each step runs in a subshell)
    echo "check failed: $*" >&2
    exit 1
}
log=$(mktemp -d)
trap 'cleanup; rm -rf "$log"' EXIT

echo "=== build: $IMAGE from $BASE_IMAGE"
start=$(now)
docker build "${network_args[@]}" -f "$here/Dockerfile" -t "$IMAGE" "${build_args[@]}" "${extra_build_args[@]}" "$repo"
record build "$start" $?
if [ "$failed" -ne 0 ]; then
    summary
    exit 1
fi

volume=rapidlite-smoke-$$
docker volume create "$volume" >/dev/null
run() { # the image's entrypoint with these arguments, no network, /workspace on the test's volume
    docker run --rm --network none -v "$volume:/workspace" "$IMAGE" "$@"
}
inspect() { # a Python snippet in the image, /workspace on the test's volume
    docker run --rm --network none -v "$volume:/workspace" --entrypoint python3 "$IMAGE" -c "$1"
}

step_image() {
    local uid installed
    uid=$(docker run --rm --entrypoint id "$IMAGE" -u) || fail "id -u failed in the image"
    [ "$uid" != 0 ] || fail "the image runs as root"
    installed=$(inspect 'import importlib.metadata as m; print(m.version("rapidlite"))') || fail "no rapidlite metadata"
    [ "$installed" = "$version" ] || fail "the image holds rapidlite $installed, the source is $version"
    echo "uid $uid, rapidlite $installed"
}

step_help() {
    run --help >"$log/help" 2>&1 || { cat "$log/help"; fail "rapidlite --help failed"; }
    grep -q -- '--task' "$log/help" || fail "rapidlite --help does not list --task"
    head -3 "$log/help"
}

step_env() {
    local torch_version
    torch_version=$(inspect 'import torch; print(torch.__version__)') || fail "torch does not import"
    run env >"$log/env" 2>&1
    local code=$?
    cat "$log/env"
    [ "$code" -eq 0 ] || fail "rapidlite env exited with $code"
    grep -qF -- "$torch_version" "$log/env" || fail "rapidlite env does not name torch $torch_version"
}

tiny_gpt=(--task pretraining --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
    --micro-batch-size 4 --global-batch-size 8 --train-iters 5 --lr-warmup-iters 1 --log-interval 1
    --eval-interval 5 --eval-iters 2)

step_pretrain() {
    run "${tiny_gpt[@]}" --nproc-per-node 2 --save /workspace/runs/pretrain 2>&1 | tee "$log/pretrain"
    local code=${PIPESTATUS[0]}
    [ "$code" -eq 0 ] || fail "exit code $code"
    grep -q 'data-parallel 2' "$log/pretrain" || fail "no 'data-parallel 2': not two ranks"
    grep -q 'iteration: 5 ' "$log/pretrain" || fail "iteration 5 was not logged"
    inspect '
import json, pathlib
d = pathlib.Path("/workspace/runs/pretrain")
assert (d / "latest").read_text().strip(), "no latest checkpoint"
assert (d / "hf" / "config.json").is_file(), "no hf/config.json"
train = [r for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if r.get("iteration") == 5]
assert train, "metrics.jsonl has no record of iteration 5"
print("checkpoint", (d / "latest").read_text().strip(), "| hf/ | metrics.jsonl:", len(train), "records at iteration 5")
' || fail "the run's outputs are incomplete"
}

step_demo() {
    run --task sequence_classification --demo --epochs 1 --save /workspace/runs/demo 2>&1 | tee "$log/demo"
    local code=${PIPESTATUS[0]}
    [ "$code" -eq 0 ] || fail "exit code $code"
    local accuracy
    accuracy=$(sed -n 's/.*final validation: .*accuracy \([0-9.]*\).*/\1/p' "$log/demo" | tail -1)
    [ -n "$accuracy" ] || fail "no 'final validation: ... accuracy' line"
    awk -v a="$accuracy" 'BEGIN { exit !(a >= 0.8) }' || fail "validation accuracy $accuracy < 0.8"
    inspect '
import pathlib
d = pathlib.Path("/workspace/runs/demo")
names = ["latest", "metrics.jsonl", "hf/config.json", "hf/model.safetensors"]
try:
    import matplotlib  # noqa: F401  (a dependency: curves.png at the end of a --save run)
    names.append("curves.png")
except ImportError:
    pass
for name in names:
    assert (d / name).is_file(), f"no {name}"
print(", ".join(names), "present")
' || fail "the demo's outputs are incomplete"
}

step_compile() {
    run "${tiny_gpt[@]}" --train-iters 2 --torch-compile 2>&1 | tee "$log/compile"
    local code=${PIPESTATUS[0]}
    [ "$code" -eq 0 ] || fail "exit code $code"
    grep -q 'torch.compile: the first step took' "$log/compile" || fail "torch.compile did not compile the model"
    grep -q 'iteration: 2 ' "$log/compile" || fail "iteration 2 was not logged"
}

step_deepspeed() {
    run "${tiny_gpt[@]}" --nproc-per-node 2 --deepspeed --zero-2-memory-optimization \
        --save /workspace/runs/deepspeed 2>&1 | tee "$log/deepspeed"
    local code=${PIPESTATUS[0]}
    [ "$code" -eq 0 ] || fail "exit code $code"
    grep -q 'iteration: 5 ' "$log/deepspeed" || fail "iteration 5 was not logged"
}

steps=(image help env pretrain demo compile)
inspect 'import importlib.util, sys; sys.exit(importlib.util.find_spec("deepspeed") is None)' 2>/dev/null \
    && steps+=(deepspeed)
for step in "${steps[@]}"; do
    echo
    echo "=== $step"
    start=$(now)
    ("step_$step")
    record "$step" "$start" $?
done

summary
exit "$failed"
