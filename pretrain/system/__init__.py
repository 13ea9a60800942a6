"""What machine and packages this is: versions, devices, peaks, and the library output pretrain quiets."""
