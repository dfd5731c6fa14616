"""The flow, as Dagster assets: dataset → captions → training → evals → best checkpoint → demo."""
