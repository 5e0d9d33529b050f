"""What every stage shares about the running process: its working directory, garbage collector and peak RSS
(process), and an ordered map over a process-wide thread pool (threads)."""
