"""The calibrated path: the calibration set (data), one decoder layer materialised from the checkpoint
(dsconv.runner.layers, shared with eval), the forward hooks and the statistics they stream (hooks, stats), what the
steps share (context: the run's inputs and the activations), one linear quantized from its statistics (linear),
SmoothQuant per layer (smooth_layer), AWQ's scale search (awq), the jobs (forward_jobs, calib_jobs) and the loop that
sequences them (calibration.Calibrator)."""
