"""ftjob.worker"""
