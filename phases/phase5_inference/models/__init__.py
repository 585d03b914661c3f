"""The models phase 5's exercises run: the parameters that choose one (a named shape with seeded
weights, or a checkpoint folder), and the lab's own trained Llamas (target and drafts)."""
