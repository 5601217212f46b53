"""simharness: simulate and profile async speculative-decoding scheduling in LLM engines.

    import simharness
    sc = simharness.load_scenario("scenarios/quickstart.yaml", {"scheduler.depth": 2})
    result = simharness.run(sc, out="results")
    result.summary, result.requests, result.steps   # pandas DataFrames
"""

from simharness.calibration import calibrate, load_fit_data
from simharness.compare import compare
from simharness.fidelity import FidelityResult, run_fidelity
from simharness.frontier import Frontier, derive_k_schedule, schedule_vs_fixed, speculation_frontier, write_frontier
from simharness.hostprofile import HostProfile, fit_host_profile, host_costs, load_host_profile
from simharness.profile_grid import measure_profile
from simharness.runner import RunResult, run
from simharness.scenario import Scenario, ScenarioError, load_scenario, scenario_from_dict, sweep_points
from simharness.seeds import SEEDS, run_seed, seed_effects

__all__ = [
    "SEEDS",
    "FidelityResult",
    "Frontier",
    "HostProfile",
    "RunResult",
    "Scenario",
    "ScenarioError",
    "calibrate",
    "compare",
    "derive_k_schedule",
    "fit_host_profile",
    "host_costs",
    "load_fit_data",
    "load_host_profile",
    "load_scenario",
    "measure_profile",
    "run",
    "run_fidelity",
    "run_seed",
    "schedule_vs_fixed",
    "scenario_from_dict",
    "seed_effects",
    "speculation_frontier",
    "sweep_points",
    "write_frontier",
]
