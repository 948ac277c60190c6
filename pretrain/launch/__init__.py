"""Launching: the launch variables checked and turned into DeepSpeed's launcher command
(`launcher`, behind launch/pretrain_ora.sh), and DeepSpeed hostfiles (`hostfile`)."""
