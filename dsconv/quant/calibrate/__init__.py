"""The calibrated path: the calibration text (data), one decoder layer materialised from the checkpoint (layers), the
forward hooks and the statistics they stream (hooks, stats), AWQ's scale search (awq), the jobs (forward_jobs,
calib_jobs) and the layer runner that drives them (calibration.Calibrator)."""
