# Sourced by the bench scripts: the one server they run at a time ($server, its process group) on $url.
# shellcheck shell=bash

server=""
stop_server() {
  if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then
    kill -TERM -- "-$server" 2>/dev/null || kill -TERM "$server"
    wait "$server" 2>/dev/null || true
  fi
  server=""
}
trap stop_server EXIT

wait_ready() {  # $1: path that answers 200 once the server can serve; $2: its log; deadline 600 s
  local deadline=$((SECONDS + 600))
  until curl -sf -o /dev/null "$url$1"; do
    kill -0 "$server" 2>/dev/null || { echo "server exited; log: $2" >&2; tail -20 "$2" >&2; exit 1; }
    [ $SECONDS -lt $deadline ] || { echo "server not ready in 600 s; log: $2" >&2; exit 1; }
    sleep 1  # poll interval of a deadline-bounded wait
  done
}
