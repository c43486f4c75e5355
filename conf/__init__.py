# conf/ is installed as the package ftjob.conf so Hydra finds it from any directory
# (config_path="pkg://ftjob.conf").
