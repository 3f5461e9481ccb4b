"""The colour-square task's reward: 1 when the answer names the square's colour first, else 0.

    reward.fn=examples.vision.colour_reward:square_colour
"""

COLOURS = ("red", "green", "blue", "yellow")


def square_colour(prompt, response, ground_truth, extra, **kwargs) -> float:
    words = [w.strip(".,!").lower() for w in response.split()]
    named = next((w for w in words if w in COLOURS), None)
    return float(named == ground_truth)
