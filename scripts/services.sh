#!/usr/bin/env bash
# Checks that Redis, RabbitMQ and PostgreSQL answer on their local ports and starts any that is
# down, with the commands in DEVELOPERS.md. Exits non-zero, saying which, when one cannot start.
set -uo pipefail

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_for() { # name port seconds
  local name=$1 port=$2 deadline=$((SECONDS + $3))
  while ! port_open "$port"; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "services: $name did not come up on 127.0.0.1:$port" >&2
      return 1
    fi
    sleep 1
  done
}

start_postgres() {
  local version
  version=$(ls /etc/postgresql 2>/dev/null | head -n 1)
  [ -n "$version" ] || { echo "services: PostgreSQL is not installed" >&2; return 1; }
  pg_ctlcluster --skip-systemctl-redirect "$version" main start
}

start_redis() {
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
}

start_rabbitmq() {
  rabbitmq-server -detached
}

ensure() { # name port starter seconds
  local name=$1 port=$2 starter=$3 seconds=$4
  if port_open "$port"; then
    echo "services: $name answers on $port"
    return 0
  fi
  echo "services: $name is down on $port; starting it"
  "$starter" || { echo "services: could not start $name" >&2; return 1; }
  wait_for "$name" "$port" "$seconds"
}

status=0
ensure PostgreSQL 5432 start_postgres 60 || status=1
ensure Redis 6379 start_redis 30 || status=1
ensure RabbitMQ 5672 start_rabbitmq 120 || status=1
if [ "$status" -eq 0 ] && command -v rabbitmqctl >/dev/null 2>&1; then
  # The port opens before the broker accepts work: wait until it answers.
  rabbitmqctl -q await_startup >/dev/null 2>&1 || true
fi
exit "$status"
