"""ftjob.storage"""
