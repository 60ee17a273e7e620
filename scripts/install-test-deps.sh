#!/usr/bin/env bash
# The programs the test suite (and `make chaos`) run, from Debian packages: `make test` calls this first.
#
# When every program is on PATH it returns at once (nothing is looked up online). Otherwise, as
# root on a Debian/apt system, it installs the missing packages without letting their scripts
# start services (policy-rc.d), and stops by pid any daemon the install started anyway. Anywhere
# else it fails with the exact command to run: these tests fail rather than skip when a program is
# missing, so a machine without it cannot pass silently.
set -euo pipefail

# program   Debian package(s): the first one apt can install wins   (used by)
NEEDED=(
    "promtool     prometheus"                  # tests/integration/test_alert_rules.py: promtool check/test rules
    "prometheus   prometheus"                  # tests/integration/test_prometheus.py: a real Prometheus
    "haproxy      haproxy"                     # deploy/local: replicas behind HAProxy
    "kubectl      kubectl|kubernetes-client"   # deploy/kubernetes: rendering and checking the manifests
    "chromium     chromium"                    # the console in a real browser
    "chromedriver chromium-driver"             # WebDriver for that browser
    "stress-ng    stress-ng"                   # make chaos: memory pressure while serving
)
# Daemons the packages above may start (process names as /proc/<pid>/comm shows them: 15 characters).
DAEMONS=" prometheus haproxy prometheus-node "

say() { echo "install-test-deps: $*" >&2; }

missing_programs=()
for entry in "${NEEDED[@]}"; do
    read -r program _ <<<"$entry"
    command -v "$program" >/dev/null 2>&1 || missing_programs+=("$program")
done
[ "${#missing_programs[@]}" -eq 0 ] && exit 0

# The package for each missing program, once each.
candidate() {  # has apt an installable version of package $1?
    apt-cache policy "$1" 2>/dev/null | grep -q 'Candidate: [^(]'
}
packages=()
for entry in "${NEEDED[@]}"; do
    read -r program choices <<<"$entry"
    case " ${missing_programs[*]} " in *" $program "*) ;; *) continue ;; esac
    chosen=""
    IFS='|' read -r -a options <<<"$choices"
    if command -v apt-cache >/dev/null 2>&1; then
        for option in "${options[@]}"; do
            if candidate "$option"; then chosen=$option; break; fi
        done
    fi
    chosen=${chosen:-${options[0]}}
    case " ${packages[*]-} " in *" $chosen "*) ;; *) packages+=("$chosen") ;; esac
done

command_line="apt-get install -y --no-install-recommends ${packages[*]}"
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    say "missing: ${missing_programs[*]}"
    if command -v apt-get >/dev/null 2>&1; then
        say "install them with:  sudo $command_line"
    else
        say "install them with your package manager (Debian packages: ${packages[*]})"
    fi
    say "(tests/unit needs none of them: .venv/bin/pytest -q tests/unit)"
    exit 1
fi

daemon_pids() {  # pids of processes named like one of DAEMONS
    local dir comm
    for dir in /proc/[0-9]*; do
        comm=$(cat "$dir/comm" 2>/dev/null) || continue
        case "$DAEMONS" in *" $comm "*) echo "${dir#/proc/}" ;; esac
    done
    return 0
}

say "installing ${packages[*]} (for ${missing_programs[*]})"
running_before=" $(daemon_pids | tr '\n' ' ') "
# policy-rc.d answering 101 tells the packages' scripts not to start their services; one that is
# already there (container images ship one) is left as it is.
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
apt-get update -qq || say "apt-get update failed; trying with the package lists already here"
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
if [ -n "$(trap -p EXIT)" ]; then rm -f /usr/sbin/policy-rc.d; trap - EXIT; fi
# Stop a daemon the install started anyway, by pid; one that was running before is not ours.
for pid in $(daemon_pids); do
    case "$running_before" in
        *" $pid "*) ;;
        *) say "stopping $(cat "/proc/$pid/comm" 2>/dev/null) (pid $pid), started by its package install"
           kill "$pid" 2>/dev/null || true ;;
    esac
done

still_missing=()
for program in "${missing_programs[@]}"; do
    command -v "$program" >/dev/null 2>&1 || still_missing+=("$program")
done
if [ "${#still_missing[@]}" -gt 0 ]; then
    say "still missing after the install: ${still_missing[*]}"
    exit 1
fi
