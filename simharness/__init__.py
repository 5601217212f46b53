"""simharness: simulate and profile async speculative-decoding scheduling in LLM engines.

    import simharness
    sc = simharness.load_scenario("scenarios/quickstart.yaml", {"scheduler.depth": 2})
    result = simharness.run(sc, out="results")
    result.summary, result.requests, result.steps   # pandas DataFrames
"""

from simharness.calibration import calibrate, load_fit_data
from simharness.compare import compare
from simharness.fidelity import FidelityResult, run_fidelity
from simharness.hostprofile import HostProfile, fit_profile, host_costs, load_profile
from simharness.runner import RunResult, run
from simharness.scenario import Scenario, ScenarioError, load_scenario, scenario_from_dict, sweep_points
from simharness.seeds import SEEDS, run_seed, seed_effects

__all__ = [
    "SEEDS",
    "FidelityResult",
    "HostProfile",
    "RunResult",
    "Scenario",
    "ScenarioError",
    "calibrate",
    "compare",
    "fit_profile",
    "host_costs",
    "load_fit_data",
    "load_profile",
    "load_scenario",
    "run",
    "run_fidelity",
    "run_seed",
    "scenario_from_dict",
    "seed_effects",
    "sweep_points",
]
