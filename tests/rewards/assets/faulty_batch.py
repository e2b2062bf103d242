# Batch reward functions that each break the contract in one way, plus two well-behaved ones.
import numpy as np

REWARD_TYPE = "batch"


def scaled(reward_inputs, scale=1.0, bonus=0.0):
    return [{"overall": scale * reward_input["response_length"] + bonus} for reward_input in reward_inputs]


def numeric_types(reward_inputs):
    return [
        {
            "overall": True,
            "count": 3,
            "ratio": np.float32(0.25),
            "flag": np.bool_(False),
            "array": np.array(2.5),
        }
        for _ in reward_inputs
    ]


def wrong_length(reward_inputs):
    return [{"overall": 1.0}] * (len(reward_inputs) - 1)


def not_a_list(reward_inputs):
    return {"overall": 1.0}


def missing_overall(reward_inputs):
    scores = [{"overall": 1.0} for _ in reward_inputs]
    scores[1] = {"accuracy": 1.0, "format": 0.0}
    return scores


def not_a_dict(reward_inputs):
    return [0.5 for _ in reward_inputs]


def nan_score(reward_inputs):
    scores = [{"overall": 1.0, "accuracy": 1.0} for _ in reward_inputs]
    scores[2]["accuracy"] = float("nan")
    return scores


def inf_score(reward_inputs):
    return [{"overall": float("-inf")} for _ in reward_inputs]


def string_score(reward_inputs):
    return [{"overall": 1.0, "accuracy": "1.0"} for _ in reward_inputs]


def none_score(reward_inputs):
    return [{"overall": None} for _ in reward_inputs]


def raises(reward_inputs):
    return [{"overall": 1.0 / (reward_input["response_length"] - 4)} for reward_input in reward_inputs]
