#!/bin/bash
# What a newcomer waits for: a fresh clone of REVISION, `make demo` until the README's first key read answers
# 200 (the install included), the .venv's size then; the demo stopped (SIGTERM) and started again (installed
# already); then `make venv` (what `make test` installs on top) and the .venv's size after it.
#
#     benchmarks/fresh_clone.sh REVISION [PORT]
#
# The clone goes to a temporary folder, removed at the end; the router listens on PORT (KEYROUTE_PORT; default:
# a free one). Figures on stdout, one per line.
set -u
REVISION=${1:?usage: benchmarks/fresh_clone.sh REVISION [PORT]}
PORT=${2:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
REPO=$(git rev-parse --show-toplevel)
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
git clone -q "$REPO" "$DIR/repo" && git -C "$DIR/repo" checkout -q "$REVISION" || exit 1
cd "$DIR/repo" || exit 1

first_answer() {  # $ELAPSED: seconds from `make demo` to the first 200; $DEMO: the demo's process group
    local start end
    start=$(date +%s.%N)
    setsid env KEYROUTE_PORT="$PORT" make demo > "$DIR/demo-$1.log" 2>&1 &
    DEMO=$!
    until [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/stores/bookings/keys/C000042")" = 200 ]; do
        kill -0 "$DEMO" 2> /dev/null || { echo "the demo stopped: $DIR/demo-$1.log"; tail "$DIR/demo-$1.log"; exit 1; }
        sleep 1
    done
    end=$(date +%s.%N)
    ELAPSED=$(echo "$end - $start" | bc)
}

stop_demo() {
    kill -TERM -- -"$DEMO"
    while kill -0 "$DEMO" 2> /dev/null; do sleep 1; done
}

echo "revision $(git rev-parse --short HEAD), load average $(cut -d' ' -f1-3 /proc/loadavg)"
first_answer 1
echo "make demo, fresh clone: first answer after $ELAPSED s"
stop_demo
echo "make demo, .venv: $(du -sh --apparent-size .venv | cut -f1) ($(du -sh .venv | cut -f1) on disk)"
first_answer 2
echo "make demo again: first answer after $ELAPSED s"
stop_demo
start=$(date +%s.%N)
make venv > "$DIR/venv.log" 2>&1 || { tail "$DIR/venv.log"; exit 1; }
echo "make venv (make test's install) on top: $(echo "$(date +%s.%N) - $start" | bc) s"
echo "make test, .venv: $(du -sh --apparent-size .venv | cut -f1) ($(du -sh .venv | cut -f1) on disk)"
echo "load average $(cut -d' ' -f1-3 /proc/loadavg)"
