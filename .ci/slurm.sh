#!/usr/bin/env bash
# A one-node Slurm on this machine for tests/test_slurm.py: Debian's munge and slurm-wlm, slurmctld and slurmd on
# localhost, one partition ("debug") over this machine's CPUs. Needs root (apt-get, daemons). Idempotent. Every
# address is 127.0.0.1, so a host name missing from /etc/hosts (as in many CI containers) does not matter.
set -euo pipefail
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null
fi
node=$(hostname -s)
hardware=$(slurmd -C | head -n 1 | sed 's/^NodeName=[^ ]* //')  # the node as slurmd itself sees it
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=ppt
SlurmctldHost=$node(127.0.0.1)
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmdSpoolDir=/var/spool/slurmd
StateSaveLocation=/var/spool/slurmctld
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
KillWait=10
MinJobAge=60
NodeName=$node NodeAddr=127.0.0.1 $hardware State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
CONF
[ -s /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; }
chown -R munge:munge /etc/munge /run/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key
pgrep -x munged >/dev/null || munged --force
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 60); do
    sinfo --noheader --format=%T 2>/dev/null | grep -qx idle && exit 0
    sleep 1
done
echo "error: the one-node Slurm did not come up; see /var/log/slurm/*.log" >&2
tail -n 20 /var/log/slurm/*.log >&2
exit 1
