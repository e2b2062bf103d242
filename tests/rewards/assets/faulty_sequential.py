# Sequential reward functions for the error paths.
REWARD_NAME = "faulty"
REWARD_TYPE = "sequential"


def fails_on_empty_answer(reward_input):
    answer = reward_input["response"].split("answer:")[1]
    return {"overall": float(answer.strip() == reward_input["ground_truth"])}


def returns_list(reward_input):
    return [{"overall": 1.0}]


NOT_A_FUNCTION = 3
