"""The decoders, one module each (ar, sd, parallel = PEARL and SpecBranch, assisted = hf-assisted), over the
primitives they share (decoding), the verification rules alone (sampling), and what places SpecBranch's forks
(calibration: the target's acceptance by the draft's confidence; hrad: the H-RAD classifier)."""
