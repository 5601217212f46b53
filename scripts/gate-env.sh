# The gate's settings, shared by scripts/ci-gate and scripts/refresh-baseline (sourced from the repository root):
# the simharness command, the gate's scenario, its baseline, the runs a side, the `--set` options and the CPU pin.
sh=.venv/bin/simharness
[ -x "$sh" ] || sh=simharness
scenario=${CI_GATE_SCENARIO:-scenarios/ci.yaml}
baseline=${CI_GATE_BASELINE:-results/baselines/ci}
runs=${CI_GATE_RUNS:-1}
sets=()
for s in ${CI_GATE_SET:-}; do sets+=(--set "$s"); done
# CI_GATE_PIN=2-5: each run on those CPUs only (taskset), as the baseline's runs were: a GPU run's process that
# lands on any core spreads more from run to run (docs/ci.md, "Measured again")
pin=()
if [ -n "${CI_GATE_PIN:-}" ]; then pin=(taskset -c "$CI_GATE_PIN"); fi
