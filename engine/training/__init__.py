"""Tools that train: a distilled draft (distill), an EAGLE-style draft head (head_distill) and the H-RAD classifier
(hrad), over shared data helpers (common). Never on benchmark prompts (data/README.md)."""
