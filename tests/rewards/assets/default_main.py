# No REWARD_TYPE (EasyR1 then assumes "batch") and the function is called `main`, EasyR1's default name.


def main(reward_inputs):
    return [{"overall": float(len(reward_input["response"]))} for reward_input in reward_inputs]
