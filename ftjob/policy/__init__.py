"""ftjob.policy"""
