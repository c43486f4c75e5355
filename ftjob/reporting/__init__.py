"""ftjob.reporting"""
