"""Routing policies: schema, validation, evaluation, what-if simulation, versions. Pure: no
network, no Redis, no engine or gateway imports; only reads the files it is asked to load.
See tokenyard/policies/README.md for the document's keys."""
from .cost import estimate_cost, format_money, parse_money
from .errors import PolicyError, Problem
from .evaluate import Decision, Denial, EngineState, TenantSpend, decide
from .export import canonical_json, diff, policy_hash, policy_to_dict, policy_to_yaml
from .matching import RequestFeatures
from .schema import Policy
from .simulate import Comparison, SimulationReport, UsageFeatures, compare, simulate
from .validation import build_policy, check_policy, load_policy, load_policy_file
from .version import PolicyVersion, next_version, rollback_to

__all__ = ["Comparison", "Decision", "Denial", "EngineState", "Policy", "PolicyError", "PolicyVersion", "Problem",
           "RequestFeatures", "SimulationReport", "TenantSpend", "UsageFeatures", "build_policy", "canonical_json",
           "check_policy", "compare", "decide", "diff", "estimate_cost", "format_money", "load_policy",
           "load_policy_file", "next_version", "parse_money", "policy_hash", "policy_to_dict", "policy_to_yaml",
           "rollback_to", "simulate"]
