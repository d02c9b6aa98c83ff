#!/usr/bin/env bash
# The compose stack in a real container engine, Docker or Podman:
#   build the image -> compose up -> the hardening is in force (read-only root,
#   no capabilities, no-new-privileges, a memory limit, encoders and PD off the
#   public network) -> the quick start's requests -> SIGKILL the encoder, then
#   PD: each must be back and healthy within RECOVER_S with >= 95% of the
#   requests sent around the kill answered 200 -> compose stop (every server
#   drains and exits 0) -> compose down -> the E+P+D stack
#   (docker-compose.epd.yml) with a video model (EPD_VIDEO_MODEL): an image, a
#   video and a hostile video (refused with a 400), then stop and down -> no
#   volume left behind.
#
#   deploy/test-containers.sh                 # docker if `docker info` works, else podman
#   ENGINE=podman deploy/test-containers.sh
#
# Environment (all optional):
#   ENGINE            docker | podman
#   COMPOSE           the compose command (default: `docker compose`, or `podman-compose`)
#   EPD_IMAGE         tag to build and run (default epd-cluster:test)
#   BASE_IMAGE, TORCH_EXTRA_INDEX_URL, TORCH_FIND_LINKS, PIP_INDEX_URL
#                     build arguments (deploy/Dockerfile); unset = its defaults
#   CA_BUNDLE         a PEM file given to the build as the secret ca_bundle
#   BUILD_NETWORK     e.g. `host`, for an index served on the host's 127.0.0.1
#   SKIP_BUILD=1      use the EPD_IMAGE that is already there
#   NO_CACHE=1        build every layer again (the build time of a first build)
#   EPD_PROXY_PORT    host port of the proxy (default 18000, on 127.0.0.1)
#   RECOVER_S         how long a killed service may take to be healthy again (30)
#   EPD_VIDEO_MODEL   the E+P+D stack's model, one that takes videos (default the preset
#                     qwen2.5-vl-tiny, built by each service into its tmpfs cache at start)
#   RESULTS           a file to append the figures to (key=value lines)
#
# Podman: unless CONTAINERS_CONF is set, deploy/podman-containers.conf is used
# (runc, cgroupfs, file events, lower ulimits: what a host without systemd and
# with a mixed cgroup layout needs). Without systemd nothing runs health checks
# on their own, so this script runs them every 5 s while it works.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[test-containers] %s\n' "$*" >&2; }
fail() { log "FAIL: $*"; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

if [ -z "${ENGINE:-}" ]; then
  if command -v docker > /dev/null && docker info > /dev/null 2>&1; then ENGINE=docker
  elif command -v podman > /dev/null && podman info > /dev/null 2>&1; then ENGINE=podman
  else fail "no working container engine (docker or podman)"; fi
fi
if [ "$ENGINE" = podman ]; then
  COMPOSE=${COMPOSE:-podman-compose}
  export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/deploy/podman-containers.conf}
else
  COMPOSE=${COMPOSE:-docker compose}
fi

PROJECT=epdtest$$
IMAGE=${EPD_IMAGE:-epd-cluster:test}
PORT=${EPD_PROXY_PORT:-18000}
RECOVER_S=${RECOVER_S:-30}
BASE="http://127.0.0.1:$PORT"
WORK=$(mktemp -d)
export EPD_IMAGE=$IMAGE EPD_PROXY_PORT=$PORT EPD_PROXY_BIND=127.0.0.1
# A fresh token, readable by the containers' user whatever the caller's umask.
(umask 022 && head -c 32 /dev/urandom | base64 | tr -d '\n' > "$WORK/internal-token")
export EPD_INTERNAL_TOKEN_SECRET_FILE=$WORK/internal-token

# shellcheck disable=SC2206
compose=($COMPOSE -p "$PROJECT" -f deploy/docker-compose.yml)
# shellcheck disable=SC2206
compose_epd=($COMPOSE -p "$PROJECT" -f deploy/docker-compose.yml -f deploy/docker-compose.epd.yml)
ticker_pid=
cleanup() {
  local job
  for job in $(jobs -p); do kill "$job" 2> /dev/null || true; done
  if [ -n "$ticker_pid" ]; then kill "$ticker_pid" 2> /dev/null || true; fi
  "${compose_epd[@]}" down > /dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

record() {
  log "$1=$2"
  if [ -n "${RESULTS:-}" ]; then echo "$1=$2" >> "$RESULTS"; fi
}

container() {  # the id of service $1's (first) container
  $ENGINE ps -aq --filter "label=com.docker.compose.project=$PROJECT" \
    --filter "label=com.docker.compose.service=$1" | head -n 1
}

# --- build -------------------------------------------------------------------
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  build=("$ENGINE" build -f deploy/Dockerfile -t "$IMAGE")
  for arg in BASE_IMAGE TORCH_EXTRA_INDEX_URL TORCH_FIND_LINKS PIP_INDEX_URL; do
    if [ -n "${!arg+set}" ]; then build+=(--build-arg "$arg=${!arg}"); fi
  done
  if [ -n "${CA_BUNDLE:-}" ]; then build+=(--secret "id=ca_bundle,src=$CA_BUNDLE"); fi
  if [ -n "${BUILD_NETWORK:-}" ]; then build+=(--network "$BUILD_NETWORK"); fi
  if [ "${NO_CACHE:-0}" = 1 ]; then build+=(--no-cache); fi
  t0=$(now)
  "${build[@]}" . >&2
  record build_s "$(since "$t0")"
  record image_size "$($ENGINE image inspect -f '{{.Size}}' "$IMAGE")"
fi
if $ENGINE image inspect -f '{{.Config.Volumes}}' "$IMAGE" | grep -q /; then
  fail "the image declares a VOLUME: $($ENGINE image inspect -f '{{.Config.Volumes}}' "$IMAGE")"
fi

# --- up ----------------------------------------------------------------------
$ENGINE volume ls -q | sort > "$WORK/volumes.before"
if [ "$ENGINE" = podman ]; then
  (while sleep 5; do
    for id in $($ENGINE ps -q --filter "label=com.docker.compose.project=$PROJECT"); do
      $ENGINE healthcheck run "$id" > /dev/null 2>&1 || true
    done
  done) &
  ticker_pid=$!
fi
wait_ready() {  # $1 = the name of the figure to record; the compose command follows
  local name=$1 t0 deadline
  shift
  t0=$(now)
  "$@" up -d >&2
  deadline=$(($(date +%s) + 600))
  until [ "$(curl -s -o /dev/null -w '%{http_code}' "$BASE/health")" = 200 ]; do
    [ "$(date +%s)" -lt "$deadline" ] || { "$@" logs >&2 || true; fail "not ready after 600 s"; }
    sleep 0.5
  done
  record "$name" "$(since "$t0")"
}
wait_ready ready_s "${compose[@]}"

# --- the hardening is in force ----------------------------------------------------
check_hardening() {  # every EPD service's container, as the engine runs it
  local service id networks
  for service in "$@"; do
    id=$(container "$service")
    [ -n "$id" ] || fail "no container for $service"
    [ "$($ENGINE inspect -f '{{.HostConfig.ReadonlyRootfs}}' "$id")" = true ] || fail "$service: writable root"
    $ENGINE inspect -f '{{.HostConfig.CapDrop}}' "$id" | grep -qi all || fail "$service: capabilities kept"
    $ENGINE inspect -f '{{.HostConfig.SecurityOpt}}' "$id" | grep -q no-new-privileges \
      || fail "$service: no no-new-privileges"
    [ "$($ENGINE inspect -f '{{.HostConfig.Memory}}' "$id")" -gt 0 ] || fail "$service: no memory limit"
    # /models belongs to the service's user (deploy/Dockerfile): only the read-only root keeps it unwritten.
    if $ENGINE exec "$id" sh -c 'touch /models/written' > /dev/null 2>&1; then fail "$service: wrote to its root"; fi
    $ENGINE exec "$id" sh -c 'touch /tmp/written /var/cache/epd/written' || fail "$service: cannot write its tmpfs"
    networks=$($ENGINE inspect -f '{{range $name, $_ := .NetworkSettings.Networks}}{{$name}} {{end}}' "$id")
    case "$service:$networks" in
      proxy:*public*) ;;
      proxy:*) fail "proxy is not on the public network: $networks" ;;
      *public*) fail "$service is on the public network: $networks" ;;
    esac
  done
  log "hardened: $*"
}
check_hardening pd encoder proxy

# --- the quick start's requests ---------------------------------------------------
RED=iVBORw0KGgoAAAANSUhEUgAAAEAAAABACAIAAAAlC+aJAAAAX0lEQVR4nO3PQQ0AIBDAMMC/50MEj4ZkVbDtWX87OuBVA1oDWgNaA1oDWgNaA1oDWgNaA1oDWgNaA1oDWgNaA1oDWgNaA1oDWgNaA1oDWgNaA1oDWgNaA1oDWgNaA9oFUoUBf3Xr7AgAAAAASUVORK5CYII=
BLUE=iVBORw0KGgoAAAANSUhEUgAAAEAAAABACAIAAAAlC+aJAAAAYElEQVR4nO3PQQ0AIBDAsAP/nkEEj4ZkVbCtmTM/2zrgVQNaA1oDWgNaA1oDWgNaA1oDWgNaA1oDWgNaA1oDWgNaA1oDWgNaA1oDWgNaA1oDWgNaA1oDWgNaA1oDWgPaBVCHAX/y3CvgAAAAAElFTkSuQmCC
MODEL=$(curl -sf "$BASE/v1/models" | sed -n 's/.*"id" *: *"\([^"]*\)".*/\1/p' | head -n 1)
[ -n "$MODEL" ] || fail "GET /v1/models named no model"
cat > "$WORK/chat.json" << EOF
{"model": "$MODEL", "max_tokens": 32, "messages": [{"role": "user", "content": [
  {"type": "image_url", "image_url": {"url": "data:image/png;base64,$RED"}},
  {"type": "text", "text": "What is in this image?"}]}]}
EOF
cat > "$WORK/stream.json" << EOF
{"model": "$MODEL", "max_tokens": 32, "stream": true, "messages": [{"role": "user", "content": [
  {"type": "image_url", "image_url": {"url": "data:image/png;base64,$RED"}},
  {"type": "image_url", "image_url": {"url": "data:image/png;base64,$BLUE"}},
  {"type": "text", "text": "Compare the two images."}]}]}
EOF
chat() {  # POSTs $1 once; prints the HTTP status
  curl -s -o "$WORK/reply" -w '%{http_code}' --max-time 60 "$BASE/v1/chat/completions" \
    -H 'Content-Type: application/json' -d @"$1"
}
[ "$(chat "$WORK/chat.json")" = 200 ] || fail "chat with an image: $(cat "$WORK/reply")"
grep -q '"finish_reason"' "$WORK/reply" || fail "no finish_reason: $(cat "$WORK/reply")"
[ "$(chat "$WORK/stream.json")" = 200 ] || fail "streamed chat with two images: $(cat "$WORK/reply")"
grep -q '^data: \[DONE\]' "$WORK/reply" || fail "the stream did not end with [DONE]"
log "the quick start's requests answered 200"

# --- SIGKILL a service's process; it must come back by itself ----------------
# 40 requests, one every 0.5 s, the kill after the 10th. Each request is what
# a client with retries sends (the OpenAI SDK retries 5xx and refused
# connections): curl retries for up to RECOVER_S seconds.
send_around_kill() {  # $1 = results file (one HTTP status a line, 000: no answer); runs in the background
  # (-o a regular file: a retry truncates it, and /dev/null cannot be truncated)
  for n in $(seq 1 40); do
    (code=$(curl -sS -o "$1.$n" -w '%{http_code}' --max-time 60 --retry 60 --retry-all-errors --retry-delay 1 \
      --retry-max-time "$RECOVER_S" "$BASE/v1/chat/completions" -H 'Content-Type: application/json' \
      -d @"$WORK/chat.json" 2>> "$1.err") || true
    echo "${code:-000}" >> "$1") &
    sleep 0.5
  done
  wait
}

kill_and_recover() {  # $1 = service, $2 = gRPC port, $3 = ready service name
  local id restarts t0 ok
  id=$(container "$1")
  [ -n "$id" ] || fail "no container for $1"
  restarts=$($ENGINE inspect -f '{{.RestartCount}}' "$id")
  : > "$WORK/$1.codes"
  send_around_kill "$WORK/$1.codes" &
  local sender=$!
  sleep 5
  t0=$(now)
  # SIGKILL of the service's process, the child of the container's init: what
  # a crash or the OOM killer does. (Not `$ENGINE kill`: Podman marks a
  # container it killed as stopped by the user and never restarts it.)
  # The exec's own status is lost when the container dies under it; the
  # restart count below says whether the kill happened.
  $ENGINE exec "$id" python -c \
    'import os; os.kill(int(open("/proc/1/task/1/children").read().split()[0]), 9)' > /dev/null 2>&1 || true
  until [ "$($ENGINE inspect -f '{{.RestartCount}}' "$id")" -gt "$restarts" ] \
    && $ENGINE exec "$id" epd health --address "127.0.0.1:$2" --service "$3" > /dev/null 2>&1; do
    awk -v t="$(since "$t0")" -v m="$RECOVER_S" 'BEGIN { exit !(t > m) }' \
      && fail "$1 not back and healthy $RECOVER_S s after SIGKILL"
    sleep 0.5
  done
  record "${1}_recover_s" "$(since "$t0")"
  wait "$sender"
  ok=$(grep -c '^200$' "$WORK/$1.codes" || true)
  record "${1}_requests_ok" "$ok/40"
  [ "$ok" -ge 38 ] || fail "only $ok of 40 requests around the $1 kill succeeded: \
$(sort "$WORK/$1.codes" | uniq -c | tr '\n' ' ') $(sort "$WORK/$1.codes.err" 2> /dev/null | uniq -c)"
}

kill_and_recover encoder 21051 epd.v1.Encoder
kill_and_recover pd 21061 epd.v1.PrefillDecode
[ "$(chat "$WORK/chat.json")" = 200 ] || fail "after the kills: $(cat "$WORK/reply")"

# --- drain and down ----------------------------------------------------------
ids=$($ENGINE ps -aq --filter "label=com.docker.compose.project=$PROJECT")
t0=$(now)
"${compose[@]}" stop >&2
record stop_s "$(since "$t0")"
for id in $ids; do
  code=$($ENGINE inspect -f '{{.State.ExitCode}}' "$id")
  [ "$code" = 0 ] || fail "$($ENGINE inspect -f '{{.Name}}' "$id") exited $code on stop (a drain ends in 0)"
done
"${compose[@]}" down >&2
[ -z "$($ENGINE ps -aq --filter "label=com.docker.compose.project=$PROJECT")" ] || fail "containers left after down"

# --- E+P+D with a video model: an image, a video, a hostile video ------------------
export EPD_MODEL=${EPD_VIDEO_MODEL:-qwen2.5-vl-tiny}
wait_ready epd_ready_s "${compose_epd[@]}"
check_hardening pd decode encoder proxy
MODEL=$(curl -sf "$BASE/v1/models" | sed -n 's/.*"id" *: *"\([^"]*\)".*/\1/p' | head -n 1)
[ -n "$MODEL" ] || fail "GET /v1/models named no model (E+P+D)"
# The videos are made in the proxy's container, with the image's own PyAV: a 16-frame MP4, and MJPEG whose
# header says 32x32 and whose next frame is 8192x8192 (refused for its codec, before a frame is decoded).
$ENGINE exec "$(container proxy)" python -c '
import base64, io, sys
from fractions import Fraction
import av, numpy as np
from PIL import Image

def clip():
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as box:
        stream = box.add_stream("mpeg4", rate=Fraction(4))
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for index in range(16):
            pixels = np.full((48, 64, 3), 12 * index, np.uint8)
            box.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        box.mux(stream.encode(None))
    return out.getvalue()

def grower():
    out = io.BytesIO()
    with av.open(out, mode="w", format="matroska") as box:
        stream = box.add_stream("mjpeg", rate=Fraction(4))
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuvj420p"
        for index, size in enumerate((32, 8192)):
            jpeg = io.BytesIO()
            Image.new("RGB", (size, size)).save(jpeg, format="JPEG", quality=20)
            packet = av.Packet(jpeg.getvalue())
            packet.stream, packet.time_base, packet.pts, packet.dts = stream, Fraction(1, 4), index, index
            box.mux(packet)
    return out.getvalue()

sys.stdout.write(base64.b64encode(clip()).decode() + " " + base64.b64encode(grower()).decode())
' > "$WORK/videos" || fail "could not make the test videos in the proxy container"
read -r CLIP GROWER < "$WORK/videos" || true  # (no newline at the end: read says EOF)
[ -n "${GROWER:-}" ] || fail "the test videos came out empty"
video_body() {  # $1 = media type, $2 = base64 file
  printf '{"model": "%s", "max_tokens": 16, "messages": [{"role": "user", "content": [
    {"type": "video_url", "video_url": {"url": "data:%s;base64,%s"}},
    {"type": "text", "text": "What happens?"}]}]}' "$MODEL" "$1" "$2"
}
sed "s|\"model\": \"[^\"]*\"|\"model\": \"$MODEL\"|" "$WORK/chat.json" > "$WORK/epd-chat.json"
[ "$(chat "$WORK/epd-chat.json")" = 200 ] || fail "E+P+D chat with an image: $(cat "$WORK/reply")"
video_body video/mp4 "$CLIP" > "$WORK/video.json"
[ "$(chat "$WORK/video.json")" = 200 ] || fail "E+P+D chat with a video: $(cat "$WORK/reply")"
grep -q '"video_tokens": *[1-9]' "$WORK/reply" || fail "no video tokens counted: $(cat "$WORK/reply")"
video_body video/x-matroska "$GROWER" > "$WORK/grower.json"
[ "$(chat "$WORK/grower.json")" = 400 ] || fail "the MJPEG probe was not refused: $(cat "$WORK/reply")"
grep -q unsupported_video_format "$WORK/reply" || fail "the MJPEG probe: $(cat "$WORK/reply")"
[ "$(chat "$WORK/video.json")" = 200 ] || fail "a video after the probe: $(cat "$WORK/reply")"
log "E+P+D: an image, a video and a refused hostile video"
ids=$($ENGINE ps -aq --filter "label=com.docker.compose.project=$PROJECT")
"${compose_epd[@]}" stop >&2
for id in $ids; do
  code=$($ENGINE inspect -f '{{.State.ExitCode}}' "$id")
  [ "$code" = 0 ] || fail "$($ENGINE inspect -f '{{.Name}}' "$id") exited $code on stop (E+P+D)"
done
"${compose_epd[@]}" down >&2
[ -z "$($ENGINE ps -aq --filter "label=com.docker.compose.project=$PROJECT")" ] || fail "containers left after down"
$ENGINE volume ls -q | sort > "$WORK/volumes.after"
left=$(comm -13 "$WORK/volumes.before" "$WORK/volumes.after")
[ -z "$left" ] || fail "volumes left after down: $left"
log "PASS"
