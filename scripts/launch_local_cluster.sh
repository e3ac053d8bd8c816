#!/usr/bin/env bash
# Prove the `ray up` launch path on this machine (cluster/cluster_local.yaml): the real
# `ray up` over SSH to a head on 127.0.0.1 and a worker on 127.0.0.2, then
# `epd serve --address auto` on the head answering a chat request, then `ray down`.
# Needs root once (a user `epdnode`, an SSH server on loopback: Debian's openssh-server,
# installed with apt-get if missing) and the project venv in /work/main/.venv or $EPD_VENV.
# Not part of the test suite: it takes minutes. Usage: ./scripts/launch_local_cluster.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${EPD_VENV:-/work/main/.venv}"
YAML=cluster/cluster_local.yaml
PORT=8785   # the HTTP port of this run (another Ray may hold 8000)
KEY=~/.ssh/epd_local_cluster
step() { printf '\n=== %s  [%s]\n' "$*" "$(date -u +%H:%M:%S)"; }

step "SSH server on loopback and the node user"
command -v sshd >/dev/null || [ -x /usr/sbin/sshd ] || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server rsync; }
id epdnode >/dev/null 2>&1 || useradd -m -s /bin/bash epdnode
[ -f "$KEY" ] || { mkdir -p ~/.ssh && ssh-keygen -q -t ed25519 -N '' -f "$KEY"; }
install -d -m 700 -o epdnode -g epdnode ~epdnode/.ssh
install -m 600 -o epdnode -g epdnode "$KEY.pub" ~epdnode/.ssh/authorized_keys
if ! ssh -o BatchMode=yes -o StrictHostKeyChecking=no -i "$KEY" epdnode@127.0.0.2 true 2>/dev/null; then
  ssh-keygen -A >/dev/null; mkdir -p /run/sshd
  /usr/sbin/sshd -o ListenAddress=127.0.0.1 -o ListenAddress=127.0.0.2 -o PasswordAuthentication=no
fi
for ip in 127.0.0.1 127.0.0.2; do ssh -o BatchMode=yes -o StrictHostKeyChecking=no -i "$KEY" epdnode@$ip true && echo "ssh epdnode@$ip ok"; done

step "ray up $YAML"
started=$(date +%s)
# The v1 autoscaler that the local provider needs is set in the YAML's head start command.
"$VENV/bin/ray" up "$YAML" --yes --no-config-cache
echo "ray up took $(( $(date +%s) - started )) s"

cleanup() {
  "$VENV/bin/ray" exec "$YAML" '[ -f ~/serve.pid ] && kill $(cat ~/serve.pid) 2>/dev/null; rm -f ~/serve.pid' || true  # `ray stop` leaves drivers running
  step "ray down $YAML"; "$VENV/bin/ray" down "$YAML" --yes
}
trap cleanup EXIT

step "epd serve --address auto, on the head"
"$VENV/bin/ray" exec "$YAML" "cd ~/epd; nohup .venv/bin/epd serve --config configs/multi_node_cpu.yaml --address auto --port $PORT > ~/serve.log 2>&1 & echo \$! > ~/serve.pid"
for _ in $(seq 400); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" || { "$VENV/bin/ray" exec "$YAML" "tail -20 ~/serve.log"; exit 1; }
echo
"$VENV/bin/ray" exec "$YAML" "tail -3 ~/serve.log"

step "ray status (nodes and their resources)"
"$VENV/bin/ray" exec "$YAML" "ray status" | sed -n '/Resources/,$p' | head -20

step "a chat request over HTTP"
curl -sS "http://127.0.0.1:$PORT/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model": "tiny-llava", "messages": [{"role": "user", "content": "Hello there, how are you?"}], "temperature": 0, "max_tokens": 12}'
echo
step "where the workers run"
"$VENV/bin/ray" exec "$YAML" "cd ~/epd && .venv/bin/python -c \"
import ray; from ray._private import state
ray.init(address='auto', log_to_driver=False)
ips = {n['NodeID']: n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']}
for a in state.actors().values():
    if a['State'] == 'ALIVE' and a['ActorClassName'].endswith('Worker'):
        print(a['ActorClassName'], 'on node', ips[a['Address']['NodeID']])
\""

step "stop epd serve"
# SIGTERM: `epd serve` shuts Serve down and exits; wait for it, since `ray stop` leaves drivers alive.
"$VENV/bin/ray" exec "$YAML" 'pid=$(cat ~/serve.pid); kill $pid; for s in $(seq 120); do kill -0 $pid 2>/dev/null || { echo "epd serve exited after $s s"; rm ~/serve.pid; break; }; sleep 1; done'
