"""ftjob.driver"""
